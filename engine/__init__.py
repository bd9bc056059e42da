"""MoE Chat's inference engine: offloaded Mixture-of-Experts generation.

Routed experts live in host memory; the device holds everything else plus a
bounded cache of experts. The engine never imports Qt and is usable without the
worker process: `loader.load_model` returns an `OffloadedModel`, and
`generation.generate` is a generator of typed events.

Rooms, bottom up (a room imports only rooms below it; `tests/test_layering.py`
holds the order):

- base modules: `errors`, `config`, `generation_config`, `resources`, `sampling`,
  `textstream` (no torch in the first four);
- `model/` — checkpoints and architecture adapters (DESIGN.md layers 1–2);
- `offload/` — host store, device cache, transfer, offloaded MoE layer (3–6);
- `metrics` — the DESIGN.md metrics computed from the cache's counters;
- `speculative/` — drafters, verification, draft length, prefetch (7–8);
- `generation`, `loader`, `prompts`, `options` — the engine's public API (10);
- `tune/` — hardware auto-tune (9);
- `worker/` — the worker process and its protocol;
- `remote/` — a remote OpenAI-compatible engine behind the worker's interface (11);
- `bench/`, `cli` — `python -m engine.bench` and `python -m engine`.
"""
