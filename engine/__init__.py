"""MoE Chat's inference engine: offloaded Mixture-of-Experts generation.

Routed experts live in host memory; the device holds everything else plus a
bounded cache of experts. The engine never imports Qt and is usable without the
worker process: `load_model` returns an `OffloadedModel`, and `generate` is a
generator of typed events.
"""
