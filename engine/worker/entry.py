"""The worker process's target, importable without torch.

`multiprocessing` pickles a process target by module and name, so the client
names this function; the engine (and torch with it) is imported only in the
spawned process.
"""

from __future__ import annotations

import logging


def run_worker(conn, log_level: int = logging.WARNING) -> None:
    from engine.worker.loop import worker_main

    worker_main(conn, log_level)
