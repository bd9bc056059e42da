"""The model picker's "Remote" tab: saved OpenAI-compatible engines, their keys and models.

A remote is a name, an address and a model (`engine.remote.RemoteEndpoint`), kept by
`app.settings.remotes.RemoteStore` (remotes.json) with its API key in the OS keyring, never in a
file. The page lists them, edits one in a form (the key field shows only whether a key is kept;
an empty field keeps it), fetches the server's model list on a worker thread (`BackgroundCall`,
with the remote worker's own timeouts and error messages), and asks for the engine the window
talks to: `sig_engine_chosen(name)` for a remote, `sig_engine_chosen(None)` for the local one.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.gui.models.background import BackgroundCall
from app.settings.remotes import RemoteStore
from engine.errors import EngineError
from engine.remote.endpoint import RemoteEndpoint

log = logging.getLogger(__name__)

COLUMNS = ("Name", "Address", "Model", "API key", "")
IN_USE = "● in use"
PROBE_TIMEOUT_S = 15.0


def served_models(
    endpoint: RemoteEndpoint, api_key: str | None, timeout_s: float = PROBE_TIMEOUT_S
) -> list[str]:
    """The model ids `endpoint` serves (its /v1/models), through the remote worker itself: the same
    timeouts and the same clear errors as a chat. Raises `EngineError` (`RemoteError`)."""
    from engine.remote.worker import RemoteTimeouts, RemoteWorker
    from engine.worker.protocol import Error, Loaded, LoadModel

    worker = RemoteWorker(endpoint, api_key, RemoteTimeouts(connect_s=timeout_s, request_s=timeout_s))
    try:
        worker.start(timeout_s)
        worker.send(LoadModel("models", None))
        event = worker.poll(timeout_s + 5)
        while event is not None and not isinstance(event, Loaded | Error):  # telemetry comes between
            event = worker.poll(timeout_s + 5)
    finally:
        worker.kill()
    if isinstance(event, Loaded):
        return list(event.model.get("models") or [])
    raise EngineError(event.message if event is not None else f"{endpoint.base_url} did not answer in time.")


class RemotePage(QWidget):
    sig_engine_chosen = Signal(object)
    """Talk to this engine: a saved remote's name, or None for the local engine."""
    sig_message = Signal(str)
    """A line for the picker's message area."""

    def __init__(self, store: RemoteStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.store = store
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.table.itemSelectionChanged.connect(self._edit_selected)
        self.name = QLineEdit(placeholderText="e.g. lab cluster")
        self.address = QLineEdit(placeholderText="http://gpu-box:8000 (the OpenAI API root; /v1 is added)")
        self.api_key = QLineEdit(echoMode=QLineEdit.EchoMode.Password)
        self.model = QComboBox(editable=True)
        self.model.lineEdit().setPlaceholderText("the server's first model")
        self.status = QLabel(wordWrap=True, objectName="remoteStatus")
        self.fetch_button = QPushButton("Fetch models")
        self.fetch_button.clicked.connect(self.fetch_models)
        self.save_button = QPushButton("Save")
        self.save_button.clicked.connect(self.save)
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self.delete)
        self.use_button = QPushButton("Use this engine")
        self.use_button.clicked.connect(self.use_selected)
        self.local_button = QPushButton("Use the local engine")
        self.local_button.clicked.connect(lambda: self.sig_engine_chosen.emit(None))
        self._lay_out()
        self.refresh()

    def _lay_out(self) -> None:
        form = QFormLayout()
        form.addRow("Name", self.name)
        form.addRow("Address", self.address)
        form.addRow("API key", self.api_key)
        model_row = QHBoxLayout()
        model_row.addWidget(self.model, 1)
        model_row.addWidget(self.fetch_button)
        form.addRow("Model", model_row)
        buttons = QHBoxLayout()
        for button in (self.save_button, self.delete_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        buttons.addWidget(self.local_button)
        buttons.addWidget(self.use_button)
        intro = QLabel(
            "Chat with a model served elsewhere: vLLM or SGLang on a cluster, llama.cpp, Ollama, or "
            "another MoE Chat (any OpenAI-compatible server). Keys stay in the system keyring.",
            wordWrap=True,
        )
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addWidget(self.table, 1)
        layout.addLayout(form)
        layout.addWidget(self.status)
        layout.addLayout(buttons)

    # -- the list ------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Show the saved remotes, the one in use marked."""
        remotes, active = self.store.remotes(), self.store.active()
        self.table.setRowCount(len(remotes))
        for row, endpoint in enumerate(remotes):
            key = "kept" if self.store.key(endpoint) else "none"
            cells = (endpoint.name, endpoint.base_url, endpoint.model or "first listed", key, "")
            if active is not None and active.name == endpoint.name:
                cells = (*cells[:-1], IN_USE)
            for column, text in enumerate(cells):
                self.table.setItem(row, column, QTableWidgetItem(text))
        self.table.resizeColumnToContents(0)
        if self.store.problems:
            self._say(" ".join(self.store.problems))
        self._update_buttons()

    def selected(self) -> RemoteEndpoint | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows:
            return None
        name = self.table.item(rows[0].row(), 0).text()
        return next((r for r in self.store.remotes() if r.name == name), None)

    def _edit_selected(self) -> None:
        endpoint = self.selected()
        if endpoint is not None:
            self.name.setText(endpoint.name)
            self.address.setText(endpoint.base_url)
            self.model.setEditText(endpoint.model or "")
            kept = self.store.key(endpoint) is not None
            self.api_key.clear()
            self.api_key.setPlaceholderText("kept — leave empty to keep it" if kept else "none (optional)")
        self._update_buttons()

    def _update_buttons(self) -> None:
        chosen = self.selected() is not None
        self.delete_button.setEnabled(chosen)
        self.use_button.setEnabled(chosen)
        self.local_button.setEnabled(self.store.active() is not None)

    # -- actions -------------------------------------------------------------------------------

    def form_endpoint(self) -> RemoteEndpoint:
        """The remote the form describes; raises `EngineError` with what to fix."""
        return RemoteEndpoint(self.name.text(), self.address.text(), self.model.currentText().strip() or None)

    def save(self) -> RemoteEndpoint | None:
        try:
            endpoint = self.form_endpoint()
            where = self.store.save(endpoint, self.api_key.text().strip() or None)
        except (EngineError, ValueError) as err:
            self._say(str(err))
            return None
        self.api_key.clear()
        self.refresh()
        self._select(endpoint.name)
        self._say(f"Saved {endpoint.name}." + (f" Its key is kept in {where}." if where else ""))
        return endpoint

    def delete(self) -> None:
        endpoint = self.selected()
        if endpoint is not None:
            self.store.delete(endpoint.name)
            self.refresh()
            self._say(f"Deleted {endpoint.name} and its key.")

    def use_selected(self) -> None:
        endpoint = self.selected()
        if endpoint is not None:
            self.sig_engine_chosen.emit(endpoint.name)

    def fetch_models(self) -> None:
        """List the server's models into the model box (on a worker thread)."""
        try:
            endpoint = self.form_endpoint()
        except EngineError as err:
            self._say(str(err))
            return
        typed = self.api_key.text().strip() or None
        saved = next((r for r in self.store.remotes() if r.name == endpoint.name), None)
        key = typed or (self.store.key(saved) if saved is not None else None)
        self.fetch_button.setEnabled(False)
        self._say(f"Asking {endpoint.base_url} for its models…")
        BackgroundCall(
            lambda: served_models(endpoint, key), self._show_models, self._fetch_failed, self
        ).start()

    def _show_models(self, models: object) -> None:
        self.fetch_button.setEnabled(True)
        current = self.model.currentText()
        self.model.clear()
        self.model.addItems(list(models))
        self.model.setEditText(current if current in models else (models[0] if models else ""))
        self._say(f"The server serves {len(models)} model(s)." if models else "The server lists no models.")

    def _fetch_failed(self, error: Exception) -> None:
        self.fetch_button.setEnabled(True)
        self._say(str(error))

    def _select(self, name: str) -> None:
        for row in range(self.table.rowCount()):
            if self.table.item(row, 0).text() == name:
                self.table.selectRow(row)

    def _say(self, message: str) -> None:
        self.status.setText(message)
        self.sig_message.emit(message)
