"""A blocking call run off the GUI thread, its outcome delivered on it.

`BackgroundCall(work, on_success, on_failure, owner)` runs a blocking function (a Hub search,
a folder check in a child process, a token check) on a worker thread and delivers its result,
or the exception it raised, on the GUI thread; nothing is delivered once `owner` is destroyed.
An expected failure (`EXPECTED_ERRORS`) is logged as one warning line, its traceback at debug
level (the log file); anything else is a bug and logged with its traceback.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import ClassVar

from PySide6.QtCore import QObject, Qt, Signal

from app.download_child import HubError
from app.model_library import ModelImportError
from engine.errors import EngineError

log = logging.getLogger(__name__)

EXPECTED_ERRORS = (HubError, ModelImportError, ValueError, EngineError)  # EngineError: a remote's


class BackgroundCall(QObject):
    """Run `work()` on a worker thread; report on the GUI thread (see the module docstring)."""

    _sig_finished = Signal(object, object)
    """The work ended: its result, or None, and the exception it raised, or None."""

    _running: ClassVar[set[BackgroundCall]] = set()  # each call lives until it has reported

    def __init__(
        self,
        work: Callable[[], object],
        on_success: Callable[[object], None],
        on_failure: Callable[[Exception], None],
        owner: QObject | None = None,
    ):
        super().__init__()
        self._work, self._on_success, self._on_failure = work, on_success, on_failure
        self._owner_gone = False
        if owner is not None:
            owner.destroyed.connect(self._forget_owner)
        self._sig_finished.connect(self._deliver, Qt.ConnectionType.QueuedConnection)

    def start(self) -> None:
        BackgroundCall._running.add(self)
        threading.Thread(target=self._run, name="background-call", daemon=True).start()

    def _run(self) -> None:
        try:
            result = self._work()
        except EXPECTED_ERRORS as err:  # reported to the user, not raised on a bare thread
            log.warning("%s", err)
            log.debug("Details:", exc_info=True)
            self._sig_finished.emit(None, err)
        except Exception as err:
            log.warning("Background work failed", exc_info=True)
            self._sig_finished.emit(None, err)
        else:
            self._sig_finished.emit(result, None)

    def _forget_owner(self) -> None:
        self._owner_gone = True

    def _deliver(self, result: object, error: Exception | None) -> None:
        BackgroundCall._running.discard(self)
        if self._owner_gone:
            return
        if error is None:
            self._on_success(result)
        else:
            self._on_failure(error)
