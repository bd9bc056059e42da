"""Benchmarks: `python -m engine.bench` (`main`), `--compare` (`compare`), `--tuned`
(`tuned`) and the load-time benchmark `python -m engine.bench.load` (`load`).

The top of the engine: it may import every layer; nothing in the engine imports it.
"""
