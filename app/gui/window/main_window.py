"""The main window: conversations on the left, the chat in the middle, the live dashboard on the right.

It owns the `EngineClient` and the conversation store and wires them to the
widgets. The `ChatSession` owns each reply from request to end and stores it
(also when stopped, also the part streamed before an engine crash), so the
user's conversations never depend on the worker; the window hears one
`sig_reply_ended` per reply and picks the banner from its finish reason.
Errors are banners with an action; a crashed worker is restarted and the
model loaded again.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QDockWidget, QLabel, QMainWindow, QScrollArea, QSplitter, QVBoxLayout, QWidget

from app.gui.chat.chat_session import ChatSession, FinishReason, Reply, context_text
from app.gui.chat.chat_view import ChatView
from app.gui.chat.conversation_list import ConversationList
from app.gui.dashboard.dashboard import Dashboard
from app.gui.engine.engine_client import ConnectionState, EngineClient
from app.gui.engine.engine_state import SIMULATED_LINK, EngineState, state_line
from app.gui.settings.settings_dialog import SettingsDialog
from app.gui.widgets.banner import BannerArea
from app.gui.widgets.window_state import WindowMemory, available_geometry, fit_to_screen
from app.gui.window.window_conversations import Conversations
from app.gui.window.window_engine import TUNE_REMOTE, EngineChoice, model_name
from app.gui.window.window_server import ServerControl
from app.settings import AppSettings, SettingsStore
from app.settings.remotes import REMOTES_FILE, RemoteStore
from app.storage import ConversationStore
from engine.worker.protocol import Stats

log = logging.getLogger(__name__)

FIRST_SIZE = QSize(1280, 800)  # the window's size on a first start, shrunk to fit a smaller screen


class MainWindow(EngineChoice, Conversations, ServerControl, QMainWindow):
    def __init__(
        self,
        store: ConversationStore | None = None,
        settings_store: SettingsStore | None = None,
        client: EngineClient | None = None,
        remotes: RemoteStore | None = None,
    ):
        super().__init__()
        self.setWindowTitle("MoE Chat")
        self.store = store or ConversationStore()
        self.settings_store = settings_store or SettingsStore()
        self.settings: AppSettings = self.settings_store.load()
        self.client = client or EngineClient(self)
        # the remote engines beside settings.json; the one in use (if any) answers instead of the worker
        self.remotes = remotes or RemoteStore(self.settings_store.path.parent / REMOTES_FILE)
        self._engine_from_store()
        self.model_info: dict | None = None
        self._load_id: str | None = None
        self.downloads = None  # app.gui.models.downloads.DownloadManager, made when the picker first opens
        self.latest_stats: Stats | None = None
        self.state = EngineState.STARTING

        self.banners = BannerArea(self)
        self.setAcceptDrops(True)  # a GGUF file or model folder dropped on the window opens it
        self.conversations = ConversationList(self.store, self)
        self.chat_view = ChatView(self)
        self.dashboard = Dashboard(self, columns=2)
        # Before the session's own slot: the first message must still be stored to retitle the chat.
        self.chat_view.sig_edit_resend.connect(self._retitle_on_edit)
        self.session = ChatSession(self.store, self.client, self.chat_view, lambda: self.settings)
        self._build_layout()
        self._build_server()
        self._build_menus()
        self._connect()
        self.conversations.refresh()
        self._open_latest_conversation()
        self.memory = WindowMemory(self.settings_store.path.parent)
        if not self.memory.restore(self, {"main": self.splitter}, available_geometry(self)):
            self._first_start_geometry()
        self._set_state(EngineState.STARTING)
        self.dashboard.set_decoding(self.settings.spec_mode, self.settings.prefetch)
        if self.settings_store.problems:  # a damaged settings file: what fell back to defaults
            text = "Some settings were reset: " + " ".join(self.settings_store.problems)
            self.banners.show_banner(text, "warning", [("Settings…", self.open_settings)], key="settings")

    # -- layout ------------------------------------------------------------------------------------

    def _build_layout(self) -> None:
        center = QWidget(self)
        column = QVBoxLayout(center)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.banners)
        column.addWidget(self.chat_view, 1)
        splitter = QSplitter(Qt.Orientation.Horizontal, self)
        splitter.addWidget(self.conversations)
        splitter.addWidget(center)
        splitter.setStretchFactor(1, 1)
        splitter.setChildrenCollapsible(False)
        self.setCentralWidget(splitter)
        self.splitter = splitter
        scroll = QScrollArea(self, widgetResizable=True, frameShape=QScrollArea.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(self.dashboard)  # scrolls rather than making the window taller than the screen
        dock = QDockWidget("Dashboard", self)
        dock.setObjectName("dashboard")
        dock.setWidget(scroll)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
        self.dashboard_dock = dock
        self.engine_label = QLabel(self)
        self.context_label = QLabel(self, objectName="contextUse")  # the open chat's tokens of the window
        self.statusBar().addPermanentWidget(self.context_label)
        self.statusBar().addPermanentWidget(self.engine_label)

    def _first_start_geometry(self) -> None:
        """1280×800, or the screen's free area where that is smaller; narrower side panes there."""
        fit_to_screen(self, FIRST_SIZE, available_geometry(self))
        width = self.width()
        self.splitter.setSizes([min(260, width // 5), width])
        dock_width = max(280, min(420, width * 3 // 10))
        self.resizeDocks([self.dashboard_dock], [dock_width], Qt.Orientation.Horizontal)

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        self._action(file_menu, "&New chat", self.new_conversation, QKeySequence.StandardKey.New)
        self._action(file_menu, "&Models…", self.open_model_picker, "Ctrl+M")
        self._action(file_menu, "&Open a GGUF file…", self.open_model_file, QKeySequence.StandardKey.Open)
        self._action(file_menu, "&Settings…", self.open_settings, QKeySequence.StandardKey.Preferences)
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit)
        chat_menu = self.menuBar().addMenu("&Chat")
        self._action(chat_menu, "Chat &settings…", self.open_chat_settings, "Ctrl+Shift+S")
        engine_menu = self.menuBar().addMenu("&Engine")
        self._action(engine_menu, "&Auto-tune for this machine…", self.open_tune_wizard)
        self._action(engine_menu, "&Restart engine", self.restart_engine)
        self._action(engine_menu, "Local &server…", self.open_server_panel)
        view_menu = self.menuBar().addMenu("&View")
        view_menu.addAction(self.dashboard_dock.toggleViewAction())
        view_menu.addAction(self.server_dock.toggleViewAction())

    def _action(self, menu, text: str, slot, shortcut=None) -> QAction:
        action = QAction(text, self)
        if shortcut is not None:
            action.setShortcut(shortcut)
        action.triggered.connect(slot)
        menu.addAction(action)
        return action

    def _connect(self) -> None:
        c = self.client
        c.sig_ready.connect(self._on_ready)
        c.sig_load_progress.connect(self._on_load_progress)
        c.sig_loaded.connect(self._on_loaded)
        c.sig_notice.connect(lambda rid, message: self.banners.show_banner(message, "warning", key="notice"))
        c.sig_stats.connect(self._on_stats)
        c.sig_error.connect(self._on_error)
        c.sig_worker_died.connect(self._on_worker_died)
        self.session.sig_reply_ended.connect(self._on_reply_ended)
        for started in (
            self.chat_view.sig_send,
            self.chat_view.sig_regenerate,
            self.chat_view.sig_edit_resend,
        ):
            started.connect(self._on_reply_started)  # after the session's slots: it is busy by now
        self.conversations.sig_selected.connect(self._on_conversation_selected)
        self.conversations.sig_new_requested.connect(self.new_conversation)
        self.conversations.sig_deleted.connect(self._on_conversation_deleted)
        self.session.sig_conversation_changed.connect(self._on_conversation_changed)
        self.session.sig_opened.connect(self._show_context)

    # -- engine ------------------------------------------------------------------------------------

    def start_engine(self) -> None:
        """Start the worker and load the configured model (the demo model when none is set)."""
        self.client.start()
        self.load_model()

    def load_model(self) -> None:
        self.model_info = None
        self._serve_loaded(None)  # the server's requests wait for the model being loaded
        self.dashboard.set_model(None)  # never the old model's name while another one loads
        self.dashboard.set_decoding(self.settings.spec_mode, self.settings.prefetch)
        self.chat_view.set_input_enabled(False, "Loading the model…")
        self._load_id = self.client.load_model(*self._load_target())
        if self.state not in (EngineState.STARTING, EngineState.RESTARTING):  # those wait for Ready
            self._set_state(EngineState.LOADING)

    def restart_engine(self) -> None:
        self.session.abandon_reply("The engine was restarted.")
        self._set_state(EngineState.RESTARTING)
        self.client.restart()
        self.load_model()

    def _on_ready(self, ready) -> None:
        device = ready.device
        log.info("Engine ready on %s (%s)", device.kind.upper(), device.name)
        if self.state in (EngineState.STARTING, EngineState.RESTARTING) and self._load_id is not None:
            self._set_state(EngineState.LOADING, f"on {device.kind.upper()}")

    def _on_load_progress(self, request_id: str, stage: str, done: int, total: int) -> None:
        if request_id == self._load_id and total:
            self._set_state(EngineState.LOADING, f"{stage} {done}/{total}")

    def _on_loaded(self, request_id: str, model: dict) -> None:
        if request_id != self._load_id:
            return
        model = {**model, "name": model_name(model)}
        self.model_info = model
        self._serve_loaded(model)
        self.session.set_model_thinks(bool(model.get("thinks")))
        self._show_context()
        self.dashboard.set_model(model)
        self.chat_view.set_input_enabled(True)
        self.banners.clear("load")
        if any(b.key == "engine" and b.kind == "error" for b in self.banners.banners()):  # back after a crash
            self.banners.clear("engine")
            note = (
                "The engine stopped unexpectedly and was restarted: the model is loaded again, "
                "your conversations are safe."
            )
            self.banners.show_banner(note, "info", key="engine", timeout_ms=8000)
        self._set_state(EngineState.GENERATING if self.session.busy else EngineState.IDLE)

    def _on_stats(self, stats: Stats) -> None:
        self.latest_stats = stats
        if self.state is EngineState.IDLE and stats.generating:  # a banner's Retry, the local server
            self._set_state(EngineState.GENERATING)
        elif self.state is EngineState.GENERATING and not stats.generating and not self.session.busy:
            self._set_state(EngineState.IDLE)  # a reply of the local server's ended
        self.dashboard.update_stats(stats)

    def _on_reply_started(self, *_args) -> None:
        if self.session.busy and self.state is EngineState.IDLE:
            self._set_state(EngineState.GENERATING)

    def _show_context(self, *_) -> None:
        info = self.model_info or {}
        windows = [w for w in (info.get("context_length"), info.get("context_limit")) if w]
        window = min(windows) if windows else None
        self.context_label.setText(context_text(self.session.context_use(), window))

    def _on_reply_ended(self, reply: Reply) -> None:
        self._show_context()
        self.dashboard.reply_ended(reply.finished.stats if reply.finished is not None else None)
        if self.state is EngineState.GENERATING:
            self._set_state(EngineState.IDLE)
        if reply.message is not None:  # the conversation gained a reply: its preview and order change
            self.conversations.refresh()
        if reply.reason is FinishReason.CUT:  # a remote's stream was cut: the part received is kept
            why = reply.error or "The connection was cut mid-reply."
            why += "" if "kept" in why else " The part received is kept."
            self.banners.show_banner(why, "error", [("Retry", self.session.regenerate)], key="reply")
        if reply.reason is FinishReason.ERROR:
            actions = [("Retry", self.session.regenerate)]
            message = reply.error
            if reply.error_kind == "context_length_exceeded" and self.session.droppable_turns():
                actions = [("Drop oldest turns", self.session.drop_oldest_turns)]  # older turns left out
            elif reply.error_kind == "context_length_exceeded":  # the message alone is too long
                actions = [("Settings…", self.open_settings)]
                message += " This message alone is too long: shorten it, or raise the context length."
            self.banners.show_banner(message, "error", actions, key="reply")

    def _on_error(self, request_id: str, kind: str, message: str) -> None:
        """A request other than a reply failed: the model's load, or something else."""
        if request_id == self._load_id:
            self.chat_view.set_input_enabled(False, "No model is loaded.")
            self._set_state(EngineState.NO_MODEL)
            actions = [("Retry", self.load_model), ("Settings…", self.open_settings)]
            actions.append(("Models…", self.open_model_picker))
            self.banners.show_banner(
                f"The model could not be loaded: {message}", "error", actions, key="load"
            )
        else:
            self.banners.show_banner(message, "error", key="engine-error")

    def _set_state(self, state: EngineState, detail: str = "") -> None:
        """The one place the engine's state changes: the status bar and the dashboard say the same."""
        self.state = state
        if state.has_model and self.model_info is not None and self.model_info.get("remote") and not detail:
            detail = f"remote {self.model_info.get('base_url')}"
        elif state.has_model and self.model_info is not None and not detail:
            link = SIMULATED_LINK if self.model_info.get("simulated_link") else self.model_info.get("device")
            detail = " · ".join(
                p for p in (f"{self.model_info.get('cache_slots')} cached experts", link) if p
            )
        name = self.model_info["name"] if self.model_info else self._wanted_name()
        line = state_line(state, name, detail)
        self.engine_label.setText(line)
        self.dashboard.set_state(state, line)

    def _wanted_name(self) -> str:
        """The name of the model being loaded: a remote's, or the model folder's."""
        active = self.remotes.active()
        if active is not None:
            return f"{active.model or 'a model'} · {active.name}"
        return model_name({"path": self._model_path()})

    def _model_path(self) -> str:
        from engine.resources import demo_model_dir

        return str(self.settings.model_path or demo_model_dir())

    # -- settings and models -----------------------------------------------------------------------

    def open_settings(self) -> None:
        gpu = self.client.ready is not None and self.client.ready.device.kind == "cuda"
        dialog = SettingsDialog(self.settings, self, gpu_available=gpu, remotes=self.remotes)
        dialog.sig_applied.connect(self.apply_settings)
        dialog.sig_engine_chosen.connect(self.use_engine)
        dialog.sig_remotes_requested.connect(lambda: self.open_model_picker(remote_tab=True))
        dialog.set_tune_available(self.model_info is not None)
        dialog.sig_tune_requested.connect(lambda: (dialog.reject(), self.open_tune_wizard()))
        dialog.exec()

    def open_tune_wizard(self) -> None:
        """The auto-tune wizard for the loaded model; its result is applied like settings."""
        from app.gui.tune.tune_wizard import TuneWizard

        if self.model_info is None or self.model_info.get("remote"):
            why = TUNE_REMOTE if self.model_info else "Load a model before tuning."
            self.banners.show_banner(why, "warning", key="tune")
            return
        wizard = TuneWizard(self.client, self.settings, self, stats=self.latest_stats)
        wizard.sig_apply.connect(self.apply_settings)
        wizard.exec()

    def apply_settings(self, settings: AppSettings, reload: bool = True) -> None:
        old, self.settings = self.settings, settings
        self.settings_store.save(settings)
        self._serve_defaults()
        self.dashboard.set_decoding(settings.spec_mode, settings.prefetch)
        local = self.remotes.active() is None  # a remote's model does not use the local settings
        if (
            reload
            and local
            and AppSettings.needs_reload(old, settings)
            and self.client.state is ConnectionState.READY
        ):
            self.load_model()

    # -- window ------------------------------------------------------------------------------------

    def bring_to_front(self) -> None:
        self.setWindowState(self.windowState() & ~Qt.WindowState.WindowMinimized)
        self.show()
        self.raise_()
        self.activateWindow()

    def closeEvent(self, event) -> None:
        self.memory.save(self, {"main": self.splitter})
        self.session.abandon_reply("The app was closed.")
        self.local_server.stop()
        self.client.shutdown()
        if self.downloads is not None:
            self.downloads.shutdown()
        self.store.close()
        super().closeEvent(event)
