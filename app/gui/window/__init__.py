"""The main window: conversations, chat and dashboard together, and the engine and model it runs.

- `main_window`: `MainWindow`, which owns the `EngineClient` and the conversation store, wires
  them to the screens and shows errors as banners;
- `window_engine`: the window's choice of engine (the local worker or a saved remote) and model;
- `window_conversations`: opening, creating and retitling conversations, a chat's settings;
- `window_server`: the local server's dock, serving the model the window has loaded.

May import: every room below it (`widgets`, `engine` and the screens `chat`, `dashboard`,
`models`, `server`, `settings`, `tune`). Never `startup`.
"""
