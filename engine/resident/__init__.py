"""The resident (non-expert) weights: loaded onto the device, GGUF matrices kept in their blocks.

- `weights`: fills the model's resident parameters from the checkpoint (a GGUF's quantized
  matrices and embedding kept quantized where the engine can compute them);
- `ggml_linear`: `GgmlLinear`, a linear layer whose weight stays in its GGUF blocks;
- `ggml_embedding`: `GgmlEmbedding`, a token embedding whose table stays in its GGUF blocks;
- `device_blocks`: `BlocksLinear`, a linear layer whose weight stays in its GGUF blocks on a GPU,
  one row through the fused quantized GEMV (`engine.gpu`).

May import: the engine's base modules, `engine.model`, `engine.ggml`, `engine.formats`, `engine.gpu`.
Never MoE execution, decoding or anything above.
"""
