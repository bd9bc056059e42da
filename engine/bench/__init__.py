"""Benchmarks: `python -m engine.bench` (`main`), `--compare` (`compare`), `--tuned`
(`tuned`), the load-time benchmark `python -m engine.bench.load` (`load`) and what constrained
decoding costs a token, `python -m engine.bench.constrained` (`constrained`).

The top of the engine: it may import every layer; nothing in the engine imports it.
"""
