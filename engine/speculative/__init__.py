"""Speculative decoding and expert prefetch (DESIGN.md layers 7–8).

`drafters` (a draft model, SS-MoE self-draft, SubSpec substitutes) and `mtp` (the
checkpoint's own multi-token-prediction layer) propose tokens;
`decoder` runs one step top to bottom (draft → verify in one forward → accept →
rewind both caches) with `acceptance` (greedy, rejection sampling, adaptive) and
`draft_len` (MoESD's N(t) and the adaptive draft length); `prefetch` predicts the
experts verification needs while the draft runs (SP-MoE, next-layer, HybriMoE), up to
the `cutoff` layer. `auto` says what `auto` speculation and prefetch mean for one model.

May import: the engine's base modules, `engine.model`, the experts' rooms (`store`,
`device_cache`, `moe`), `engine.decode`, `engine.offloaded_model`,
`engine.sampling` and `engine.metrics`. Never generation, tune, worker or bench.
"""
