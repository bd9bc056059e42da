"""The host expert store (DESIGN.md layer 3): every routed expert in host RAM, in its format.

- `host_store`: `ExpertLayout` (where each field of an expert lies in its buffer) and
  `ExpertStore` (one contiguous buffer a layer, one row an expert); the bf16 builder;
- `from_gguf`, `from_fp8`, `from_int4`, `from_mxfp4`, `from_compressed_tensors`: stores built
  from pre-quantized checkpoints, kept in their format; `prequantized` holds what they share;
- `disk_cache`: converted (int8/int4) stores kept on disk, so a second load skips the work;
- `staging`: a pinned staging ring feeding the link without pinning every expert.

May import: the engine's base modules, `engine.model`, `engine.ggml`, `engine.formats`.
Never the device cache, MoE execution, decoding or anything above.
"""
