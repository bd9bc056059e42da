"""Quantized weight formats and their reference numerics (DESIGN.md layer 3).

- `int_quant`: the group-wise int8/int4 quantization the engine applies to bf16 experts;
- `fp8`: FP8 e4m3 weights with block or per-tensor scales, dequantized;
- `int4`: GPTQ/AWQ/compressed-tensors int4 codes, zeros and scales, dequantized;
- `gguf_blocks`: every GGUF block type's fields and its dequantization in torch (ggml's
  `type_traits` table as data);
- `kquant_matmul`: `x @ W.T` straight from Q4_K/Q6_K blocks, bit for bit `gguf_blocks`';
- `gguf_repack`: GGUF blocks repacked for torch's int4/int8 CPU kernels, and the packings
  ggml computes.

May import: the engine's base modules, `engine.model` (the GGUF reader's type table) and
`engine.ggml`. Never the store, the cache, MoE execution or anything above.
"""
