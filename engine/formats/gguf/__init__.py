"""GGUF's block types: the reference numerics and the experts a GGUF file holds.

- `blocks`: every GGUF block type's fields and its dequantization in torch (ggml's
  `type_traits` table as data), and the bytes a row of blocks takes;
- `kquant_matmul`: `x @ W.T` straight from Q4_K/Q6_K blocks, bit for bit `blocks`' weight;
- `repack`: GGUF blocks repacked for torch's int4/int8 CPU kernels, and the packings ggml
  computes in place;
- `experts`: `GGUF_BLOCKS`, the format object of a GGUF file's routed experts (engine.formats.base).

May import what `engine.formats` may: the engine's base modules, `engine.model` and `engine.ggml`.
"""
