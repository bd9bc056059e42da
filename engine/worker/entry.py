"""The worker process's target, importable without torch.

`multiprocessing` pickles a process target by module and name, so the client
names this function; the engine (and torch with it) is imported only in the
spawned process. A standby worker (`engine.worker.standby`) imports first and
serves only once its client wakes it.
"""

from __future__ import annotations

import logging

WARM = b"standby: warm"  # the standby tells its client its imports are done
WAKE = b"standby: wake"  # the client tells the standby to serve


def run_worker(
    conn, log_level: int = logging.WARNING, standby: bool = False, warm_model: str | None = None
) -> None:
    if standby:
        from engine.worker.warm_up import warm_up

        warm_up(warm_model)
        try:
            conn.send_bytes(WARM)
            if conn.recv_bytes() != WAKE:  # the client's only message to a standby
                return
        except (EOFError, OSError):  # the client is gone (or never needed it)
            return
    from engine.worker.loop import worker_main

    worker_main(conn, log_level)
