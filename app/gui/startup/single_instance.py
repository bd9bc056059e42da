"""One running MoE Chat per user and data folder: a second start asks the first to come to the
front, then exits.

The first instance listens on a local socket (a named pipe on Windows) named after the user and
its data folder (MOE_CHAT_DATA_DIR, else the per-user one); a later start with the same folder
connects, sends "activate" and quits, saying so in one line. A start with another data folder
has another name, so it runs on its own: two data folders are two separate libraries and chat
lists, and one instance must never stand in for the other.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import re
from pathlib import Path

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_MS = 500


def server_name(app_id: str = "moe-chat", data_folder: str | Path | None = None) -> str:
    """The socket's name: the app, the user and, when given, a short hash of the data folder."""
    user = re.sub(r"[^A-Za-z0-9_.-]", "_", getpass.getuser())
    if data_folder is None:
        return f"{app_id}-{user}"
    folder = str(Path(data_folder).expanduser().resolve())
    return f"{app_id}-{user}-{hashlib.sha256(folder.encode()).hexdigest()[:12]}"


class SingleInstance(QObject):
    sig_activate = Signal()
    """Another start of the app asked this instance to come to the front."""

    def __init__(self, name: str | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.name = name or server_name()
        self._server: QLocalServer | None = None

    def ask_running_instance(self) -> bool:
        """True when another instance is running (and has been asked to come to the front)."""
        socket = QLocalSocket(self)
        try:
            socket.connectToServer(self.name)
            if not socket.waitForConnected(CONNECT_TIMEOUT_MS):
                return False
            socket.write(b"activate\n")
            socket.flush()
            socket.waitForBytesWritten(CONNECT_TIMEOUT_MS)
            socket.disconnectFromServer()
            return True
        finally:
            socket.abort()
            socket.setParent(None)
            del socket

    def listen(self) -> bool:
        """Become the running instance; False if the name could not be taken."""
        QLocalServer.removeServer(self.name)  # a stale socket file left by a crash
        self._server = QLocalServer(self)
        self._server.newConnection.connect(self._on_connection)
        if not self._server.listen(self.name):
            log.warning("Single-instance server %s: %s", self.name, self._server.errorString())
            return False
        return True

    def _on_connection(self) -> None:
        while self._server is not None and self._server.hasPendingConnections():
            socket = self._server.nextPendingConnection()
            socket.readyRead.connect(self._on_message)
            socket.disconnected.connect(socket.deleteLater)

    def _on_message(self) -> None:
        socket = self.sender()
        if isinstance(socket, QLocalSocket) and bytes(socket.readAll()).startswith(b"activate"):
            self.sig_activate.emit()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server.deleteLater()
            self._server = None
