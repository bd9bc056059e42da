"""The local server's panel (the window's "Local server" dock): a switch, the port, an optional API
key, the address and an example to copy, whether it starts with the app, and the request log.

It serves the model the window has loaded (`window_engine_api.LocalServer`), like LM Studio's and
Jan's server switch; the same API as `moe-chat-cli serve`.
"""

from __future__ import annotations

import json

from PySide6.QtCore import Qt
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.gui.server.window_engine_api import LocalServer
from app.settings.secrets import IN_KEYRING
from app.settings.server_prefs import ServerPrefs, ServerPrefsStore

LOG_LINES = 2000  # the request log keeps this many lines
OFF_TEXT = (
    "Off. Switched on, programs on this computer (editors, scripts, Open WebUI …) can chat with "
    "the loaded model through OpenAI's API."
)


class ServerPanel(QWidget):
    def __init__(self, server: LocalServer, store: ServerPrefsStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.server, self.store = server, store
        self.prefs = store.load()
        self.key_note = ""  # where the API key went, when it is not the keyring
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        self.switch = QPushButton("Start the server", self, checkable=True)
        self.switch.setToolTip("Serve the loaded model on this computer (127.0.0.1 only).")
        self.status = QLabel(OFF_TEXT, self, wordWrap=True)
        self.port = QSpinBox(self, minimum=1024, maximum=65535, value=self.prefs.port)
        self.api_key = QLineEdit(self, echoMode=QLineEdit.EchoMode.Password)
        self.api_key.setPlaceholderText("none: any program on this computer may use it")
        self.api_key.setText(store.api_key() or "")
        self.start_with_app = QCheckBox("Start the server when MoE Chat starts", self)
        self.start_with_app.setChecked(self.prefs.start_with_app)
        self.address = QLineEdit(self, readOnly=True)
        self.example = QPlainTextEdit(self, readOnly=True, font=mono)
        self.log = QPlainTextEdit(self, readOnly=True, font=mono)
        self.log.setMaximumBlockCount(LOG_LINES)
        self.log.setPlaceholderText("Requests to the server appear here.")
        self._build()
        self.switch.toggled.connect(self._switched)
        self.start_with_app.toggled.connect(lambda _: self._save_prefs())
        server.sig_log.connect(self.log.appendPlainText)
        server.sig_changed.connect(self.refresh)
        self.refresh()

    def _build(self) -> None:
        """Compact, for a dock under the chat: the switch, one row of options, the address, then
        the request log and the example as tabs."""
        column = QVBoxLayout(self)
        top = QHBoxLayout()
        top.addWidget(self.switch)
        top.addWidget(self.status, 1)
        column.addLayout(top)
        options = QHBoxLayout()
        options.addWidget(QLabel("Port", self))
        options.addWidget(self.port)
        options.addWidget(QLabel("API key", self))
        options.addWidget(self.api_key, 1)
        options.addWidget(self.start_with_app)
        column.addLayout(options)
        address = QHBoxLayout()
        address.addWidget(QLabel("Address", self))
        address.addWidget(self._with_copy(self.address, self.address.text), 1)
        column.addLayout(address)
        tabs = QTabWidget(self)
        requests = QWidget(tabs)
        log_column = QVBoxLayout(requests)
        log_column.setContentsMargins(0, 0, 0, 0)
        log_column.addWidget(self.log, 1)
        clear = QPushButton("Clear", requests)
        clear.clicked.connect(self.log.clear)
        log_column.addWidget(clear, 0, Qt.AlignmentFlag.AlignRight)
        tabs.addTab(requests, "Requests")
        tabs.addTab(self._with_copy(self.example, self.example.toPlainText), "Example")
        column.addWidget(tabs, 1)

    def _with_copy(self, widget: QWidget, text) -> QWidget:
        box = QWidget(self)
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(widget, 1)
        copy = QPushButton("Copy", box)
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(text()))
        row.addWidget(copy)
        return box

    # -- the switch ----------------------------------------------------------------------------------

    def start_server(self) -> bool:
        """Start listening with the panel's port and key; False (said in the panel) if it cannot."""
        self._save_prefs()
        key = self.api_key.text().strip() or None
        where = self.store.set_api_key(key)
        self.key_note = "" if where in (None, IN_KEYRING) else where
        try:
            self.server.start(self.port.value(), key)
        except OSError as err:
            self._show_off(
                f"Could not listen on port {self.port.value()} ({err.strerror or err}): another "
                "program may be using it; choose another port."
            )
            return False
        self.refresh()
        return True

    def stop_server(self) -> None:
        self.server.stop()
        self.refresh()

    def _switched(self, on: bool) -> None:
        if on and not self.server.running and not self.start_server():
            self.switch.setChecked(False)
        elif not on and self.server.running:
            self.stop_server()

    def _save_prefs(self) -> None:
        prefs = ServerPrefs(self.port.value(), self.start_with_app.isChecked())
        if prefs != self.prefs:
            self.store.save(prefs)
            self.prefs = prefs

    # -- what it shows --------------------------------------------------------------------------------

    def refresh(self) -> None:
        running = self.server.running
        self.switch.blockSignals(True)
        self.switch.setChecked(running)
        self.switch.blockSignals(False)
        self.switch.setText("Stop the server" if running else "Start the server")
        self.port.setEnabled(not running)
        self.api_key.setEnabled(not running)
        url = self.server.url or f"http://127.0.0.1:{self.port.value()}/v1"
        self.address.setText(url)
        with_key = bool(self.api_key.text().strip())
        self.example.setPlainText(example_request(url, self.server.model_id, with_key))
        if not running:
            self.status.setText(OFF_TEXT)
            return
        model = self.server.model_id
        if model is None or not self.server.engine.alive:
            text = f"On at {url}. No model is loaded yet: requests are answered once it is."
        else:
            text = f"On: serving {model} at {url}."
        self.status.setText(" ".join(p for p in (text, self.key_note) if p))

    def _show_off(self, message: str) -> None:
        self.refresh()
        self.status.setText(message)


def example_request(url: str, model: str | None, with_key: bool) -> str:
    """A curl command that asks the server for a reply: what a user copies to try it; and where
    a tool set up for Ollama finds the same model."""
    body = {"model": model or "MODEL", "messages": [{"role": "user", "content": "Hello!"}]}
    lines = [f"curl {url}/chat/completions", '-H "Content-Type: application/json"']
    if with_key:
        lines.append('-H "Authorization: Bearer YOUR_API_KEY"')
    lines.append(f"-d '{json.dumps(body)}'")
    ollama = f"# Tools set up for Ollama: use {url.removesuffix('/v1')} as the Ollama address."
    return " \\\n  ".join(lines) + "\n\n" + ollama
