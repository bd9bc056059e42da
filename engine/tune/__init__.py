"""Hardware auto-tune (DESIGN.md layer 9): probe, profile, predict, search, remember.

The result types live in `engine.tune.types` (torch-free, so the GUI can show them);
measuring is in `probe` and `profile`, the papers' models in `analytic`, the short
measured search in `search`, and persistence per (GPU, model, budget, precision) in
`store`; `run` is one tune from probe to the remembered choice.
"""
