"""The ahead-of-time kernels proven on a GPU (`python -m engine.bench.gpu`'s "kernels" stage): each
registered kernel's cubin launched through the CUDA driver on inputs at a Qwen3-30B-A3B layer's
shapes, its outputs against torch's reference, its bytes a second against the card's copy rate.

- `case` — a check's launches (a kernel's name, grid, arguments in the registry's order) and what
  judges each (its outputs against the reference, tolerances by dtype), run through any loader;
- `experts` — the routed experts' and quantized GEMVs' cases: K-quant blocks, FP8 values with block
  or tensor scales, each int4 variant, laid out as the store lays them out, in a pool;
- `decoder` — the decoder kernels' cases (norms, rotary + KV write, router, attention) and the
  smoke kernel's, with their torch references;
- `stage` — `CASES`, every registered kernel's check, and `run(limit)`.

The CPU tests build the same cases small (tests/engine/gpu/test_checks.py): every kernel has one,
its arguments pack as its manifest entry says, and Triton's interpreter runs the same launches
within the same tolerances. May import what `engine.gpu` may; imports no triton.
"""
