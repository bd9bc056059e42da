"""The device expert cache and the link (DESIGN.md layers 4–5).

- `expert_cache`: `ExpertCache`, the fixed pool of slots sized from a budget, (layer, expert) →
  slot, with hits, misses and bytes by phase;
- `slots`: a slot's buffer and state (free / loading / ready / in use) and the pool;
- `fixed_slots`: experts used without pinning (in place on the CPU, or a cache that holds every
  expert: filled at load, looked up through slot tables on the device);
- `eviction`: pure bookkeeping of LRU, LFU and MRS; `victims`: the policy's choice narrowed to
  slots that may go;
- `stats`: the cache's counters per phase;
- `transfer`: the copy stream (CUDA) or the simulated link, copies that complete on an event;
- `pipeline`: a layer's experts brought into the cache and yielded as they are ready;
- `mapped_table`: a small table the host writes and the device reads where it lies in pinned
  memory (the graph pieces' slot tables).

May import: the engine's base modules, `engine.store` and below. Never MoE execution,
decoding or anything above.
"""
