"""The Python API for a remote engine: `connect(url)` gives an `EngineSession` over a `RemoteWorker`.

    from engine.remote import connect
    session = connect("http://gpu-box:8000", api_key=os.environ.get("KEY"), model="Qwen/Qwen3-30B-A3B")
    for event in session.generate([ChatMessage("user", "Hi")]):
        ...  # Token events, then one Finished, exactly as with the local engine
    session.close()

`RemoteSession` is `EngineSession` whose lost connection is reopened to the same endpoint (never
a local worker started in its place) and the same model chosen again.
"""

from __future__ import annotations

import logging

from engine.remote.endpoint import RemoteEndpoint
from engine.remote.worker import RemoteTimeouts, RemoteWorker
from engine.worker.client import EngineSession

log = logging.getLogger(__name__)


class RemoteSession(EngineSession):
    """Blocking calls (load, generate, cancel, stats) over a remote engine."""

    def __init__(self, worker: RemoteWorker):
        super().__init__(worker)

    def ensure_worker(self) -> bool:
        if self.worker.alive:
            return False
        old = self.worker
        self.worker = old.reopened()
        self.worker.start()
        if self._loaded_with is not None:
            self._load(*self._loaded_with)
        self.restarts += 1
        log.warning("The connection to %s was reopened.", old.endpoint.base_url)
        return True


def connect(
    endpoint: RemoteEndpoint | str,
    api_key: str | None = None,
    model: str | None = None,
    timeouts: RemoteTimeouts = RemoteTimeouts(),
) -> RemoteSession:
    """A session on the remote at `endpoint` (a URL or a saved `RemoteEndpoint`) with `model` (None:
    the endpoint's default, else the first the server lists) chosen. Raises `RemoteError`."""
    if isinstance(endpoint, str):
        endpoint = RemoteEndpoint.from_url(endpoint, model)
    session = RemoteSession(RemoteWorker(endpoint, api_key, timeouts))
    try:
        session.start()
        session.load(model)
    except BaseException:
        session.close()
        raise
    return session
