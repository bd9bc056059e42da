"""The auto-tune screen: detect the hardware, profile in the engine, show the result and apply it.

- `tune_wizard`: `TuneWizard`, the four-page wizard;
- `tune_plot`: `TuneCurvePlot`, measured vs predicted TPOT against the prefetch cutoff layer;
- `tune_text`: the result in words (the chosen settings and the probed machine); no Qt.

May import: PySide6, the Qt-free modules of `app`, the engine's torch-free modules, and the
`widgets` and `engine` rooms. Never another screen, `window` or `startup`.
"""
