"""The host expert store (DESIGN.md layer 3): every routed expert in host RAM, in its format.

- `host_store`: `ExpertStore` (one contiguous buffer a layer, one row an expert), host buffers
  (`allocate_layer`) and int8/int4 copies of a native store (`quantize_store`);
- `build`: the one skeleton every format's store is built by (`build_expert_store`: refuse
  re-quantization, open the format's experts, `pack_experts` layer by layer);
- `placement`: where a layer's experts lie and in which packing, chosen apart from their format
  (`AS_STORED`; for ggml's kernels on the CPU: `CpuPlacement`, a GGUF file's or MXFP4 blocks;
  `GgmlFloats`, a float checkpoint's as ggml rows; `Int4AsQ4_0`, symmetric GPTQ as Q4_0);
- `disk_cache`: converted (int8/int4) stores kept on disk, so a second load skips the work;
- `staging`: a pinned staging ring feeding the link without pinning every expert.

May import: the engine's base modules, `engine.model`, `engine.ggml`, `engine.formats`.
Never the device cache, MoE execution, decoding or anything above.
"""
