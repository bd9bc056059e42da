"""Offloaded expert execution (DESIGN.md layers 3–6): experts in host RAM, a device cache of them.

Bottom up: `quant` (int8/int4 host stores), `expert_store` (every routed expert as one
packed host buffer) and `store_cache` (converted stores kept on disk); `eviction` (pure
bookkeeping: LRU, LFU, MRS) and `expert_cache` (the device slot pool that does the copies);
`transfer` (CUDA copy stream, or the simulated link); `moe_layer` (transformers' experts
module replaced by one that reads the cache, in named stages); `cpu_experts` + `hybrid`
(misses computed on the CPU when that is sooner); `model` (`OffloadedModel`, what the
loader returns).

May import: the engine's base modules and `engine.model`. Never `engine.speculative`,
generation, tune, worker or bench: speculation plugs in through `ExpertControl`.
"""
