"""The local server as the window runs it: `<config dir>/server.json` holds its port and whether it
starts with the app; its API key is in the OS keyring (`secrets.ApiKeys`, service
"moe-chat-server"), never in a file.

Loading never fails: a missing file gives the defaults, an unreadable one or a bad value the
default with a sentence in `problems`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from app.settings.secrets import ApiKeys
from app.settings.store import config_dir, write_json_atomically

log = logging.getLogger(__name__)

SERVER_FILE = "server.json"
SERVER_KEYRING_SERVICE = "moe-chat-server"
KEY_NAME = "local-server"
DEFAULT_PORT = 8000  # `moe-chat-cli serve`'s too


@dataclass(frozen=True)
class ServerPrefs:
    port: int = DEFAULT_PORT
    start_with_app: bool = False


def check_port(port: object) -> int:
    """`port` as a TCP port a user may listen on; raises ValueError with the reason."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        raise ValueError(f"The port must be a whole number from 1024 to 65535, not {port!r}.")
    return port


class ServerPrefsStore:
    """`ServerPrefs` as JSON beside settings.json; the API key through `keys` (the keyring)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, keys: ApiKeys | None = None):
        self.path = Path(path) if path is not None else config_dir() / SERVER_FILE
        self.keys = keys if keys is not None else ApiKeys(SERVER_KEYRING_SERVICE)
        self.problems: list[str] = []

    def load(self) -> ServerPrefs:
        self.problems = []
        try:
            stored = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return ServerPrefs()
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            self._problem(f"The server settings in {self.path} are unreadable ({err}); using the defaults.")
            return ServerPrefs()
        if not isinstance(stored, dict):
            self._problem(f"The server settings in {self.path} are not a JSON object; using the defaults.")
            return ServerPrefs()
        prefs = ServerPrefs()
        try:
            port = check_port(stored.get("port", prefs.port))
        except ValueError as err:
            self._problem(f"{err} Using {prefs.port}.")
            port = prefs.port
        return ServerPrefs(port, stored.get("start_with_app") is True)

    def save(self, prefs: ServerPrefs) -> None:
        check_port(prefs.port)
        write_json_atomically(self.path, {"version": 1, **asdict(prefs)})

    def api_key(self) -> str | None:
        return self.keys.get(KEY_NAME)

    def set_api_key(self, key: str | None) -> str | None:
        """Keep `key` (None or blank: no key); returns where it went, a sentence for the user."""
        if key is None or not key.strip():
            self.keys.delete(KEY_NAME)
            return None
        return self.keys.set(KEY_NAME, key)

    def _problem(self, message: str) -> None:
        log.warning("%s", message)
        self.problems.append(message)
