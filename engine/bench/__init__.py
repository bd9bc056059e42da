"""Benchmarks: `python -m engine.bench` (`main`), `--compare` (`compare`), `--tuned`
(`tuned`), the load-time benchmark `python -m engine.bench.load` (`load`) and what constrained
decoding costs a token, `python -m engine.bench.constrained` (`constrained`).

Their parts: `passes` (one pass of the fixed prompts, and the row it makes), `rows` (the rows and
their table), `memory` (what the process holds against what the model needs), `op_counts`
(`--count-ops`: kernels launched and host syncs a token), `llama_cpp` (`--vs-llama-cpp`: llama.cpp
on the same file), `side_by_side` (`--and-model`), `multi_turn` (`--multi-turn`), `shapes` (the
large-shape GGUF files), `gpu` (`python -m engine.bench.gpu`: the one prepared GPU check) and
`graph_check` (its stage: the decode step as one CUDA graph against the eager step, per family),
and `emulated` (`--emulate-cuda`: a CPU run laid out and stepped as on CUDA, for counting).

The top of the engine: it may import every layer; nothing in the engine imports it.
"""
