"""The PySide6 desktop app, in rooms by screen. Bottom up (a room imports only its own room and the
rooms below it; the screens never import each other):

- `widgets`: pieces any window uses and that know nothing of the engine (banners, the error
  panel, windows that fit their screen);
- `engine`: `engine_client.EngineClient`, the one owner of the worker, and the engine's state
  as the user reads it;
- the screens: `chat` (the conversation pane, its bubbles and sessions, the sidebar, per-chat
  settings), `dashboard` (live telemetry), `models` (the model picker: catalog, Hub search,
  downloads, remotes), `server` (the local server switched on from the window, its request log),
  `settings` (the settings dialog), `tune` (the auto-tune wizard);
- `window`: the main window, which puts the screens together and chooses the engine;
- `startup`: what runs around the window: the QApplication, logging, one instance per data
  folder, the system-library check and `--self-test`.

May import: PySide6, the Qt-free modules of `app`, and the engine's torch-free modules
(`engine.worker.client`, `engine.worker.protocol`, the base configs). Never torch.
"""
