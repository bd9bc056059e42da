"""The main window's local server: the "Local server" dock, and the model it serves kept in step with
the one the window loads.

Mixed into `MainWindow`: the server answers through the window's `EngineClient` with the window's
loaded model (`app.gui.server`); requests leave out what the window's settings give (speculation,
prefetch), with the server's reply length. While a server request generates, the status bar and
the dashboard say so, and its figures are the dashboard's last reply, as for a chat reply.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDockWidget, QLabel

from app.gui.dashboard.dashboard import Dashboard
from app.gui.engine.engine_client import EngineClient
from app.gui.server.server_panel import ServerPanel
from app.gui.server.window_engine_api import LocalServer
from app.session_setup import SERVED_MAX_TOKENS, model_id
from app.settings import AppSettings, SettingsStore
from app.settings.remotes import RemoteStore
from app.settings.server_prefs import SERVER_FILE, ServerPrefsStore
from engine.generation_config import SamplingConfig


class ServerControl:
    """MainWindow's part that runs the local server over its engine."""

    client: EngineClient
    dashboard: Dashboard
    settings: AppSettings
    settings_store: SettingsStore
    remotes: RemoteStore

    def _build_server(self) -> None:
        self.local_server = LocalServer(self.client, self)
        store = ServerPrefsStore(self.settings_store.path.parent / SERVER_FILE)
        self.server_panel = ServerPanel(self.local_server, store, self)
        dock = QDockWidget("Local server", self)
        dock.setObjectName("server")
        dock.setWidget(self.server_panel)
        self.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, dock)
        dock.hide()
        self.server_dock = dock
        self.server_label = QLabel(self, objectName="serverState")
        self.statusBar().addWidget(self.server_label)
        self.local_server.sig_changed.connect(self._show_server_state)
        finished = self.local_server.engine.sig_finished
        finished.connect(lambda reply: self.dashboard.reply_ended(reply.stats))
        self._serve_defaults()
        if self.server_panel.prefs.start_with_app:
            self.server_panel.start_server()
        self._show_server_state()

    def open_server_panel(self) -> None:
        """Show the dock under the chat, a third of the window high, the chat keeping the rest."""
        if self.server_dock.isHidden():
            self.server_dock.show()
            self.resizeDocks([self.server_dock], [max(220, self.height() // 3)], Qt.Orientation.Vertical)
        self.server_dock.raise_()

    def _serve_defaults(self) -> None:
        sampling = SamplingConfig()
        self.local_server.set_defaults(self.settings.generation_config(sampling, SERVED_MAX_TOKENS))

    def _serve_loaded(self, model: dict | None) -> None:
        """The server answers with `model` (the `Loaded` info), or with none while one loads."""
        if model is None:
            self.local_server.set_model(None)
        elif model.get("remote"):
            self.local_server.set_model(str(model.get("model_id")), model)
        else:
            self.local_server.set_model(model_id(self.settings.model_path), model)

    def _show_server_state(self) -> None:
        url = self.local_server.url
        self.server_label.setText(f"Server on at {url}" if url else "")
        self.server_label.setVisible(url is not None)
