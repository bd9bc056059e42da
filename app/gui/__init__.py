"""The PySide6 desktop app: the main window, chat, dashboard, model picker, settings and
the auto-tune wizard. `engine_client.EngineClient` is the one owner of the worker.

May import: PySide6, the Qt-free modules of `app`, and the engine's torch-free modules
(`engine.worker.client`, `engine.worker.protocol`, the base configs). Never torch.
"""
