"""The main window's choice of engine and model: the local worker on a model folder, or a saved
remote engine (any OpenAI-compatible server) on one of the models it serves.

`RemoteStore.active()` says which (None: local); the window's `EngineClient` is pointed at it with
`use_engine` and restarted, and the model is loaded again — for a remote, "loading" is asking the
server for the chosen model. Conversations are the app's own and stay whichever engine answers.
Auto-tune measures this computer, so it is offered for the local engine only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import QTimer

from app.gui.engine.engine_state import EngineState
from app.settings.remotes import RemoteStore
from engine.config import OffloadConfig

TUNE_REMOTE = "Auto-tune measures this computer: it runs on the local engine, not on a remote one."


def model_name(model: dict) -> str:
    """The loaded model's name for the title and the dashboard."""
    from engine.resources import demo_model_dir

    if model.get("remote"):
        return f"{model.get('model_id')} · {model.get('endpoint')}"
    path = Path(str(model.get("path", "")))
    if path == demo_model_dir():
        return "MoE Chat Demo"
    from app.model_library import ModelLibrary

    known = ModelLibrary().name_of(path)  # an imported GGUF's own name (general.name, quant type)
    return known or path.name or model.get("model_type", "model")


class EngineChoice:
    """MainWindow's part that picks the engine (mixed into it: uses its client, settings, banners)."""

    remotes: RemoteStore

    def _engine_from_store(self) -> None:
        """Point the client at the remote in use, or back at the local worker."""
        active = self.remotes.active()
        self.client.use_engine(self.remotes.worker_factory(active.name) if active is not None else None)

    def _load_target(self) -> tuple[str | None, OffloadConfig]:
        """What `LoadModel` asks for: a remote's model id (None: its first), else the model folder."""
        active = self.remotes.active()
        if active is not None:
            return active.model, OffloadConfig()
        return self.settings.model_path, self.settings.to_offload_config()

    def use_engine(self, name: str | None) -> None:
        """Talk to the saved remote `name`, or to the local engine (None); the model loads again."""
        self.remotes.set_active(name)
        self._engine_from_store()
        self.banners.clear("reply")
        self.restart_engine()

    def _on_worker_died(self, message: str) -> None:
        """Any reply in flight has ended already (`WorkerCrashed`); start a new worker and load again.
        A remote that cannot be reached is not retried in a loop: the user chooses."""
        self.model_info = None  # gone with the worker
        self._set_state(EngineState.CRASHED)
        if self.remotes.active() is not None:
            actions = [
                ("Retry", self.restart_engine),
                ("Use the local engine", lambda: self.use_engine(None)),
                ("Remote engines…", lambda: self.open_model_picker(remote_tab=True)),
            ]
            self.banners.show_banner(message, "error", actions=actions, key="engine")
            return
        self.banners.show_banner(
            f"{message} It is being restarted; your conversations are safe.",
            "error",
            actions=[("Restart again", self.restart_engine), ("Settings…", self.open_settings)],
            key="engine",
        )
        QTimer.singleShot(0, self, self._restart_after_crash)  # "crashed" is shown before "restarting"

    def _restart_after_crash(self) -> None:
        if self.state is EngineState.CRASHED:  # not restarted by the user meanwhile
            self._set_state(EngineState.RESTARTING)
            self.client.restart()
            self.load_model()

    def open_model_picker(self, remote_tab: bool = False) -> None:
        from app.gui.models.downloads import DownloadManager
        from app.gui.models.model_picker import ModelPicker

        if self.downloads is None:  # one manager for the app: downloads go on when the picker closes
            self.downloads = DownloadManager(self)
        ready = self.client.ready
        vram = ready.device.total_memory_bytes if ready and ready.device.kind != "remote" else None
        picker = ModelPicker(self, manager=self.downloads, vram_bytes=vram, remotes=self.remotes)
        picker.sig_model_chosen.connect(self._use_model)
        picker.sig_engine_chosen.connect(self.use_engine)
        if remote_tab:
            picker.tabs.setCurrentWidget(picker.remote_page)
        picker.exec()

    def open_model_file(self) -> None:
        """File → Open a GGUF file…: import the file (or a split set's first part) and load it."""
        from app.gui.models.model_import import choose_model_file

        path = choose_model_file(self)
        if path:
            self.import_and_use(path)

    def import_and_use(self, path: str) -> None:
        """Check and register a GGUF file or model folder (a file dialog's or a drop's), asking which
        file where a folder holds several GGUF models, then load it."""
        from app.gui.models.model_import import ModelImporter
        from app.model_library import ModelLibrary

        def failed(message: str) -> None:
            self.banners.show_banner(message, "warning", key="import")

        self.banners.show_banner(f"Checking {path}…", "info", key="import")
        done = lambda model: (self.banners.clear("import"), self._use_model(model.path))  # noqa: E731
        ModelImporter(ModelLibrary(), self, done, failed).start(path)

    def dragEnterEvent(self, event) -> None:  # a GGUF file or a model folder dragged on the window
        from app.gui.models.model_import import dropped_model_path

        if dropped_model_path(event.mimeData()) is not None:
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        from app.gui.models.model_import import dropped_model_path

        path = dropped_model_path(event.mimeData())
        if path is not None:
            event.acceptProposedAction()
            self.import_and_use(path)

    def _use_model(self, path: str) -> None:
        from app.gui.engine.engine_client import ConnectionState
        from engine.resources import demo_model_dir

        model_path = None if Path(path) == demo_model_dir() else path
        if self.remotes.active() is not None:  # a local model: back to the local engine
            self.apply_settings(replace(self.settings, model_path=model_path), reload=False)
            self.use_engine(None)
            return
        same = model_path == self.settings.model_path
        self.apply_settings(replace(self.settings, model_path=model_path))
        if same and self.model_info is None and self.client.state is ConnectionState.READY:
            self.load_model()  # the same model again, after it failed to load
