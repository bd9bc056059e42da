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

import os

# Idle OpenMP threads spin before they sleep. libgomp's default spin (300,000 rounds) stalls a step
# for 100s of ms whenever another process holds one of the cores; never spinning (PASSIVE) pays a
# wake-up on each of a decode step's ~500 small operators. A short spin keeps most of both:
# `python -m engine.bench --model Q4_K_M.gguf --kernels ggml --device cpu --expert-budget all
# --prompts 2 --new-tokens 32 --repeats 2` (Qwen3-30B-A3B-shaped, 2 threads on this 2-core CPU),
# tpot idle / with two busy processes on the cores: default 6.7 / 208.8 ms, PASSIVE 9.7 / 24.2 ms,
# GOMP_SPINCOUNT=10000 6.9 / 20.9 ms. OpenMP reads it once, when torch loads: set here, before any
# engine module imports torch. A user's own setting of either variable wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
