"""The local server switched on from the window, serving the model the window has loaded.

- `window_engine_api`: `WindowEngine`, the window's `EngineClient` as the server's engine (one
  worker, one loaded model, for the chat and the server), and `LocalServer`, which runs
  `app.server`'s OpenAI-compatible server over it and relays its log;
- `server_panel`: `ServerPanel`, the switch, port, API key, address, an example to copy and the
  request log.

May import: PySide6, the Qt-free modules of `app` (`app.server` when the server starts), the
engine's torch-free modules, and the rooms `widgets` and `engine`.
"""
