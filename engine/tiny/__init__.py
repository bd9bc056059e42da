"""Tiny random models of every supported family, for the tests, the bench and `make-tiny`.

- `models`: a tiny seeded model of a family, saved as a checkpoint;
- `registry`: the tiny configs, shrunk generically from transformers' config classes;
- `gguf_writer`: tiny GGUF files in llama.cpp's on-disk format (K-quants, splits);
- `kquant_encode`: quantizing a matrix into ggml blocks (gguf-py cannot make K-quants).

May import: the engine's base modules and `engine.model`. Nothing in the engine's run time
imports it: the readers never depend on the test builders.
"""
