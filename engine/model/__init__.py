"""Reading models (DESIGN.md layers 1–2): checkpoints on disk and the architecture adapters.

- `checkpoint`: lazy safetensors reading, both expert layouts (per-expert and fused);
- `adapters/`: one small entry per Hugging Face `model_type` (where the MoE blocks are,
  the router rule, shared experts);
- `check`: a model folder's completeness, without loading it;
- `tiny`: tiny random models of every supported family, for tests and `make-tiny`.

May import: the engine's base modules (`errors`, `config`, `generation_config`,
`resources`), torch, transformers and safetensors. Never the offload, speculative,
tune, worker or bench layers.
"""
