"""The GUI's side of the engine: the worker's one owner and the engine's state in the user's words.

- `engine_client`: `EngineClient`, which starts the worker (or points at a remote engine), sends
  it requests and turns its events into typed Qt signals on the GUI thread;
- `engine_state`: `EngineState` and the one wording of it that the status bar, the dashboard and
  Settings share (the simulated host→device link among it).

May import: PySide6, the Qt-free modules of `app`, and the engine's torch-free modules
(`engine.worker.client`, `engine.worker.protocol`, the base configs). No other room of `app.gui`.
"""
