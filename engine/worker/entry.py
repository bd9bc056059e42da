"""The worker process's target, importable without torch.

`multiprocessing` pickles a process target by module and name, so the client
names this function; the engine (and torch with it) is imported only in the
spawned process. A standby worker (`engine.worker.standby`) imports first and
serves only once its client wakes it.

The worker shares its client's terminal: transformers' and the Hub's tqdm bars (the
"Loading weights" bar of a draft model loaded by the first reply) are turned off in
it, so they cannot garble a terminal chat's live reply; warnings and errors still print.
"""

from __future__ import annotations

import logging
import os

WARM = b"standby: warm"  # the standby tells its client its imports are done
WAKE = b"standby: wake"  # the client tells the standby to serve


def run_worker(
    conn, log_level: int = logging.WARNING, standby: bool = False, warm_model: str | None = None
) -> None:
    quiet_progress_bars()
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


def quiet_progress_bars() -> None:
    """No tqdm progress bars from transformers or the Hub in this process (log messages stay)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read by the Hub when first imported
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # and now, should transformers be imported already
