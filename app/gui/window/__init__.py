"""The main window: conversations, chat and dashboard together, and the engine and model it runs.

- `main_window`: `MainWindow`, which owns the `EngineClient` and the conversation store, wires
  them to the screens and shows errors as banners;
- `window_engine`: the window's choice of engine (the local worker or a saved remote) and model.

May import: every room below it (`widgets`, `engine` and the screens `chat`, `dashboard`,
`models`, `settings`, `tune`). Never `startup`.
"""
