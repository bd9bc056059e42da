"""The saved remote engines: `RemoteStore` keeps them in `<config dir>/remotes.json`, their API
keys in the OS keyring (`app.settings.secrets.ApiKeys`), never in a file.

`remotes.json` holds `{"version": 1, "remotes": [{"name", "base_url", "model"}…], "active": NAME
or null}`; `active` is the remote the app talks to (null: the local engine). Loading never fails:
a missing file is no remotes, an unreadable one or a bad entry is skipped with a warning, kept in
`problems` for the GUI. For the GUI:

    store = RemoteStore()
    store.remotes()                          # [RemoteEndpoint …]
    store.save(RemoteEndpoint("lab", "http://gpu-box:8000", "deepseek-ai/DeepSeek-V3"), api_key="…")
    store.set_active("lab"); store.active()  # the RemoteEndpoint in use, or None: local
    store.keys.get(endpoint.base_url)        # the key, or None; store.set_key / delete_key
    EngineClient(worker_factory=store.worker_factory("lab"), standby_factory=None)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.settings.secrets import ApiKeys
from app.settings.store import config_dir, write_json_atomically
from engine.errors import EngineError, InvalidConfigError
from engine.remote.endpoint import RemoteEndpoint

log = logging.getLogger(__name__)

REMOTES_FILE = "remotes.json"
SCHEMA_VERSION = 1


class RemoteStore:
    """The saved remotes and which one is active; keys through `keys` (the keyring)."""

    def __init__(self, path: str | os.PathLike[str] | None = None, keys: ApiKeys | None = None):
        self.path = Path(path) if path is not None else config_dir() / REMOTES_FILE
        self.keys = keys if keys is not None else ApiKeys()
        self.problems: list[str] = []

    # -- the list ----------------------------------------------------------------------------

    def remotes(self) -> list[RemoteEndpoint]:
        return self._load()[0]

    def get(self, name: str) -> RemoteEndpoint:
        for endpoint in self.remotes():
            if endpoint.name == name:
                return endpoint
        raise InvalidConfigError(f"No saved remote engine is called {name!r}.")

    def save(self, endpoint: RemoteEndpoint, api_key: str | None = None) -> str | None:
        """Add `endpoint`, or replace the one of the same name; with `api_key`, keep it too and
        return where it went (a sentence for the user)."""
        remotes, active = self._load()
        kept = [r for r in remotes if r.name != endpoint.name]
        old = next((r for r in remotes if r.name == endpoint.name), None)
        if old is not None and old.base_url != endpoint.base_url and api_key is None:
            self.keys.delete(old.base_url)  # a key belongs to its server: not carried to a new address
        self._write([*kept, endpoint], active)
        return self.set_key(endpoint, api_key) if api_key else None

    def delete(self, name: str) -> None:
        """Forget the remote `name` and its key (it stops being the active one)."""
        remotes, active = self._load()
        gone = [r for r in remotes if r.name == name]
        for endpoint in gone:
            if not any(r.base_url == endpoint.base_url for r in remotes if r.name != name):
                self.keys.delete(endpoint.base_url)
        self._write([r for r in remotes if r.name != name], None if active == name else active)

    # -- the active remote ---------------------------------------------------------------------

    def active(self) -> RemoteEndpoint | None:
        remotes, active = self._load()
        return next((r for r in remotes if r.name == active), None)

    def set_active(self, name: str | None) -> None:
        """Talk to the remote `name` (None: the local engine)."""
        remotes, _ = self._load()
        if name is not None and all(r.name != name for r in remotes):
            raise InvalidConfigError(f"No saved remote engine is called {name!r}.")
        self._write(remotes, name)

    # -- keys and workers ----------------------------------------------------------------------

    def set_key(self, endpoint: RemoteEndpoint, api_key: str) -> str:
        return self.keys.set(endpoint.base_url, api_key)

    def key(self, endpoint: RemoteEndpoint) -> str | None:
        return self.keys.get(endpoint.base_url)

    def delete_key(self, endpoint: RemoteEndpoint) -> None:
        self.keys.delete(endpoint.base_url)

    def worker_factory(self, name: str) -> Callable[[], Any]:
        """A factory of `RemoteWorker`s (WorkerProcess's interface) for the remote `name`, with its
        key read at each start (a key changed in Settings applies on the next connect)."""
        endpoint = self.get(name)

        def make():
            from engine.remote.worker import RemoteWorker  # the openai client loads only when used

            return RemoteWorker(endpoint, self.key(endpoint))

        return make

    # -- the file ------------------------------------------------------------------------------

    def _load(self) -> tuple[list[RemoteEndpoint], str | None]:
        self.problems = []
        try:
            stored = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return [], None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            self._warn(f"Cannot read the remote engines in {self.path} ({err}); none are listed.")
            return [], None
        if not isinstance(stored, dict) or not isinstance(stored.get("remotes"), list):
            self._warn(f"{self.path} does not hold a list of remote engines; none are listed.")
            return [], None
        remotes: list[RemoteEndpoint] = []
        for entry in stored["remotes"]:
            try:
                endpoint = RemoteEndpoint(str(entry["name"]), str(entry["base_url"]), entry.get("model"))
            except (EngineError, KeyError, TypeError, AttributeError) as err:
                self._warn(f"Skipping a remote engine in {self.path}: {entry!r} ({err}).")
                continue
            if any(r.name == endpoint.name for r in remotes):
                self._warn(f"Skipping a second remote engine called {endpoint.name!r} in {self.path}.")
                continue
            remotes.append(endpoint)
        active = stored.get("active")
        return remotes, active if any(r.name == active for r in remotes) else None

    def _write(self, remotes: list[RemoteEndpoint], active: str | None) -> None:
        entries = [{"name": r.name, "base_url": r.base_url, "model": r.model} for r in remotes]
        write_json_atomically(self.path, {"version": SCHEMA_VERSION, "remotes": entries, "active": active})

    def _warn(self, problem: str) -> None:
        log.warning("%s", problem)
        self.problems.append(problem)
