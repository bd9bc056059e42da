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

# Idle OpenMP threads that spin (the default) stall a step for 100s of ms whenever another
# process holds one of the cores; sleeping ones do not. Measured with `python -m engine.bench
# --vs-llama-cpp` on a Q4_K_M file, bfloat16, 2 threads on this 2-core CPU under other jobs' load
# (average 3.4-5.9), default -> PASSIVE: decode 2.4 -> 21.5 tok/s, and 1.8 -> 8.7 when repeated
# (llama.cpp's OpenMP build in the same process: 17.0 -> 30.3, 3.4 -> 39.7). OpenMP reads it once,
# when torch loads: set here, before any engine module imports torch. A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
