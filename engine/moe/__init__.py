"""MoE execution (DESIGN.md layer 6): a layer's routed experts computed from the cache.

- `layer`: `OffloadedExperts`, transformers' experts module replaced by one that reads the cache
  in named stages, its strategy chosen once when it is installed;
- `control`: `ExpertControl`, what a run installs on every layer (prefetch observers, a draft's
  routing, CPU misses), and `DraftRouting`;
- `ggml_routes`: `InPlaceGgml`, a step's routes through ggml's `mul_mat_id` where the experts lie
  in the store (`--kernels ggml` on the CPU);
- `batched_experts`: a step's device experts gathered and computed as groups;
- `fused_experts`: a one-token step's experts through the fused GPU kernels (`engine.gpu`), two
  launches a layer, where the layer's blocks and the device allow (decided once a layer);
- `cuda_graphs`: a one-token step's experts captured and replayed as a CUDA graph a layer;
- `cpu_misses` and `hybrid_schedule`: misses computed on the CPU where that is sooner
  (HybriMoE's measured cost model and simulation);
- `routing_trace`: each MoE layer's latest router logits, for cache policies and the tuner.

May import: the engine's base modules, `engine.model`, `engine.ggml`, `engine.formats`,
`engine.gpu`, `engine.store`, `engine.device_cache`. Never decoding, speculation or anything above:
speculation plugs in through `ExpertControl`.
"""
