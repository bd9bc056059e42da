"""MoE Chat's inference engine: offloaded Mixture-of-Experts generation.

Routed experts live in host memory; the device holds everything else plus a
bounded cache of experts. The engine never imports Qt and is usable without the
worker process: `loader.load_model` returns an `OffloadedModel`, and
`generation.generate` is a generator of typed events.

Rooms, bottom up (a room imports only rooms below it; DESIGN.md describes them and
`tests/test_layering.py` holds the order):

- base modules: `errors`, `config`, `generation_config`, `resources`, `huge_pages`, then
  `sampling`, `text/` (`stream`: prompts in, text out; `reasoning`);
- `model/` — checkpoint readers and architecture adapters (DESIGN.md layers 1–2);
- `tiny/` — tiny random models for the tests, the bench and `make-tiny`;
- `ggml/` — llama.cpp's ggml C library through ctypes;
- `formats/` — quantized weight formats and their reference numerics;
- `gpu/` — fused GPU kernels of the decode step (Triton);
- `store/` — the host expert store and the checkpoint-to-store builders (3);
- `device_cache/` — the device expert cache and the link (4–5);
- `moe/` — MoE execution: the offloaded experts module and its strategies (6);
- `resident/` — the resident weights, GGUF matrices kept in their blocks;
- `decode/` — the decode step builders and the ordered list of step paths;
- `offloaded_model` — `OffloadedModel`, what the loader returns;
- `metrics` — the DESIGN.md metrics computed from the cache's counters;
- `speculative/` — drafters, verification, draft length, prefetch (7–8);
- `constraints`, `generation`, `loader`, `prompts`, `options` — the engine's public API (10);
- `tune/` — hardware auto-tune (9);
- `worker/` — the worker process and its protocol;
- `remote/` — a remote OpenAI-compatible engine behind the worker's interface (11);
- `bench/`, `cli` — `python -m engine.bench` and `python -m engine`.
"""

import os

# Idle OpenMP threads spin before they sleep. libgomp's default spin stalls a step whenever another
# process holds one of the cores; never spinning pays a wake-up on each of a decode step's many small
# operators. A short spin keeps most of both (BENCHMARKS.md). OpenMP reads it once, when torch loads:
# set here, before any engine module imports torch. A user's own setting of either variable wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
