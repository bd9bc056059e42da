"""Quantized weight formats: their numerics, and each stored expert format as one object (DESIGN.md layer 3).

The protocol and the layout:
- `base`: `ExpertFormat` (detect, reader, kept_as, open) and `StoredExperts` (layer_layout, pack),
  one object per format as vLLM has one quantization method; `ModelExperts`, what the model expects;
- `fields`: each format a stored field can be in (`PLAIN`, `GgmlBlocks`, `Fp8Blocks`, `Int4Words`) and
  the weight its views give (ggml's `type_traits` table as objects);
- `layout`: `ExpertLayout` and `ExpertField`, where each field of an expert lies in its buffer;
- `registry`: the formats in the order the loader asks them, the first that detects a checkpoint.

The formats, one module each (with their checkpoint readers):
- `gguf/`: GGUF's block types — their numerics (`blocks`, `kquant_matmul`, `repack`) and a GGUF
  file's experts in their own ggml blocks (`experts`);
- `mxfp4_experts`: gpt-oss's MXFP4 experts, repacked into ggml's MXFP4 blocks;
- `fp8_experts`: FP8 experts with block, row or tensor scales (`Fp8Checkpoint`);
- `int4_experts`: GPTQ/AWQ/compressed-tensors int4 experts in their words;
- `int4_checkpoint`: `Int4Checkpoint`, GPTQ/AWQ Linears read as floats or as stored;
- `compressed_tensors`: compressed-tensors' schemes, read as FP8 or int4;
- `packed_checkpoint`: what the pre-quantized safetensors readers share;
- `native_experts`: float experts as stored, or quantized by the engine (`IntQuantFormat`).

The numerics:
- `int_quant`: the group-wise int8/int4 quantization the engine applies to float experts;
- `fp8`: FP8 e4m3 weights with block or per-tensor scales, dequantized;
- `int4`: GPTQ/AWQ/compressed-tensors int4 codes, zeros and scales, dequantized;
- GGUF's block types: in `gguf/`.

May import: the engine's base modules, `engine.model` (checkpoints, disk layouts, the GGUF reader)
and `engine.ggml`. Never the store, the cache, MoE execution or anything above.
"""
