"""Downloading models from the Hugging Face Hub, in child processes the user can cancel.

`DownloadManager` (GUI thread) starts one spawned child per download (`app.download_child`)
and turns what it reports into signals. A download is a `ModelSource`: a whole Hub repo, or the
chosen file(s) of one quant of a GGUF repo (only those are fetched); its key (the repo id, or
'repo:QUANT') names it in every signal and method. The states the user sees:

    checking → downloading (bytes done/total, speed, ETA) → verifying → done | cancelled | failed

- Checking: the child lists the repo (sizes, git blob ids and LFS sha256 from the Hub's tree
  listing; which files still need fetching from `snapshot_download(dry_run=True)`). The
  manager then compares the bytes to fetch plus a margin with the free space on the target's
  disk, and lets the child go on only if they fit: "not enough disk space: need X, have Y"
  fails the download before any byte of it is fetched. The child then fetches config.json and
  refuses unsupported or pre-quantized models before their weights (a GGUF has no config.json:
  its header is checked after verification).
- Downloading: plain HTTP (`HF_HUB_DISABLE_XET=1` in the child), progress from a tqdm class.
- Verifying: every file's size against the listing, the sha256 of every LFS file (the
  weights) and the git blob id of every other file; a bad file is removed. Then the engine's
  folder check reads the safetensors or GGUF headers, in the child.
- Cancel kills the child and removes that download's unfinished folder (only a folder marked
  as an unfinished download, so never another model's files). A failure keeps the complete
  files, so Retry fetches only what is missing.

A download uses the token `hub_client.load_token` finds (searching the Hub and storing
the token live there too).

Every expected failure (offline, refused, a timeout, HTTP 401/403/404/429, a gated repo, a full
disk, a broken connection) reaches the user as one sentence with what to do, and its details
(`DownloadProgress.details`, `HubError.failure.details`) go to the log file at debug level:
the console gets one warning line, never a traceback (see `app.download_child.hub_errors`).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import shutil
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal

from app.catalog import format_bytes
from app.download_child import DownloadJob, DownloadProgress, DownloadState, run_download
from app.gui.models.hub_client import load_token
from app.model_library import ModelLibrary, ModelSource

__all__ = ["DownloadManager", "DownloadProgress", "DownloadState"]

log = logging.getLogger(__name__)


# -- disk space ----------------------------------------------------------------------------------


def disk_free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_margin(nbytes: int) -> int:
    """Room kept free beyond the download itself: 2% of it, at least 256 MiB."""
    return max(256 * 2**20, nbytes // 50)


# -- the manager ---------------------------------------------------------------------------------


@dataclass
class _Download:
    job: DownloadJob
    process: multiprocessing.process.BaseProcess
    events: multiprocessing.queues.Queue
    go: multiprocessing.synchronize.Event
    last: DownloadProgress


class DownloadManager(QObject):
    sig_progress = Signal(str, object)
    """A download moved on: its key, a `DownloadProgress` (throttled: the newest of each state per poll)."""
    sig_finished = Signal(str, str)
    """A download is complete and verified: its key, what the engine loads (folder or GGUF file)."""
    sig_failed = Signal(str, str)
    """A download failed: its key, the reason in words (Retry may help)."""
    sig_cancelled = Signal(str)
    """A download was cancelled and its unfinished files removed: its key."""

    def __init__(
        self,
        parent: QObject | None = None,
        library: ModelLibrary | None = None,
        endpoint: str | None = None,
        poll_ms: int = 100,
    ):
        super().__init__(parent)
        self.library = library or ModelLibrary()
        self.endpoint = endpoint
        self._context = multiprocessing.get_context("spawn")
        self._active: dict[str, _Download] = {}
        self._states: dict[str, DownloadProgress] = {}
        self._requests: dict[str, tuple[ModelSource, str]] = {}  # key → what was asked, for Retry
        self._timer = QTimer(self)
        self._timer.setInterval(poll_ms)
        self._timer.timeout.connect(self._poll)

    def state(self, key: str) -> DownloadProgress | None:
        """The newest progress of download `key`, if one was started in this session."""
        return self._states.get(key)

    def is_active(self, key: str) -> bool:
        return key in self._active

    def pid(self, key: str) -> int | None:
        """The process id of download `key`'s child, while it runs."""
        download = self._active.get(key)
        return download.process.pid if download is not None else None

    def start(self, source: ModelSource | str, revision: str = "main") -> None:
        """Download `source` (a repo id: the whole model) into the library; nothing happens if it
        is downloading already. Its key names it from now on."""
        source = ModelSource(source) if isinstance(source, str) else source
        key = source.key
        if key in self._active:
            return
        target = self.library.begin_download(key)
        job = DownloadJob(source, revision, str(target), self.endpoint, load_token())
        events, go = self._context.Queue(), self._context.Event()
        process = self._context.Process(
            target=run_download, args=(job, events, go), name=f"download {key}", daemon=True
        )
        process.start()
        log.info("Downloading %s@%s into %s (pid %s)", key, revision, target, process.pid)
        self._requests[key] = (source, revision)
        checking = DownloadProgress(key, DownloadState.CHECKING)
        self._active[key] = _Download(job, process, events, go, checking)
        self._emit_progress(checking)
        self._timer.start()

    def cancel(self, key: str) -> None:
        """Kill the download's process and remove its unfinished files."""
        download = self._active.pop(key, None)
        if download is None:
            return
        self._stop(download)
        self.library.discard_download(key)
        self._emit_progress(DownloadProgress(key, DownloadState.CANCELLED))
        self.sig_cancelled.emit(key)

    def retry(self, key: str) -> None:
        """Start a failed or cancelled download again, with what it was asked for."""
        last = self._states.get(key)
        ended = last is not None and last.state in (DownloadState.FAILED, DownloadState.CANCELLED)
        if key in self._active or not ended or key not in self._requests:
            return
        self.start(*self._requests[key])

    def shutdown(self) -> None:
        """Kill every download (app exit); finished files stay for a later Retry."""
        for download in self._active.values():
            self._stop(download)
        self._active.clear()
        self._timer.stop()

    # -- the GUI thread's poll -------------------------------------------------------------------

    def _poll(self) -> None:
        for key, download in list(self._active.items()):
            self._poll_one(key, download)
        if not self._active:
            self._timer.stop()

    def _poll_one(self, key: str, download: _Download) -> None:
        alive = download.process.is_alive()  # before draining: what a dead child sent is all in the pipe
        pending: DownloadProgress | None = None  # the newest progress not shown yet
        for event in self._drain(download):
            if event[0] == "progress":
                if pending is not None and pending.state is not event[1].state:
                    self._show(download, pending)  # a state's last figures are never skipped
                pending = event[1]
                continue
            if pending is not None:
                self._show(download, pending)
                pending = None
            if self._handle(key, download, event):
                return
        if pending is not None:
            self._show(download, pending)
        if not alive:
            self._died(key, download)

    def _show(self, download: _Download, progress: DownloadProgress) -> None:
        download.last = progress
        self._emit_progress(progress)

    @staticmethod
    def _drain(download: _Download) -> list[tuple]:
        events = []
        while True:
            try:
                events.append(download.events.get_nowait())
            except queue.Empty:
                return events
            except (OSError, EOFError, ValueError):  # a killed child may leave a torn message
                return events

    def _handle(self, key: str, download: _Download, event: tuple) -> bool:
        """Act on one event; True when the download ended with it."""
        match event:
            case ("planned", int(to_fetch)):
                self._check_disk(key, download, to_fetch)
                return key not in self._active
            case ("done", str(folder)):
                self._end(key, download)
                self.library.finish_download(key)
                total = download.last.bytes_total
                self._emit_progress(DownloadProgress(key, DownloadState.DONE, total, total))
                self.sig_finished.emit(key, str(self.library.installed_path(key) or folder))
                return True
            case ("failed", str(reason), str(details)):
                self._fail(key, download, reason, details)
                return True
            case ("log", int(level), str(name), str(message)):
                logging.getLogger(name).log(level, "download of %s: %s", key, message)
        return False

    def _check_disk(self, key: str, download: _Download, to_fetch: int) -> None:
        target = Path(download.job.target)
        need, have = to_fetch + disk_margin(to_fetch), disk_free_bytes(target)
        if need > have:
            self._stop(download)
            where = target.parent
            reason = (
                f"Not enough disk space: {format_bytes(need)} needed, {format_bytes(have)} free on {where}; "
                "free some space, then try again."
            )
            self._fail(
                key, download, reason, f"{key}: {to_fetch} bytes to fetch, {have} bytes free on {target}"
            )
            return
        download.go.set()

    def _died(self, key: str, download: _Download) -> None:
        code = download.process.exitcode
        reason = f"The download stopped unexpectedly (its process exited with code {code}): try again."
        self._fail(key, download, reason, f"download process {download.process.pid} exit code {code}")

    def _fail(self, key: str, download: _Download, reason: str, details: str = "") -> None:
        self._end(key, download)
        self.library.remove_incomplete_files(key)
        log.warning("Download of %s failed: %s", key, reason)  # one line: the details go to the file
        log.debug("Details of the failed download of %s:\n%s", key, details)
        self._emit_progress(DownloadProgress(key, DownloadState.FAILED, reason=reason, details=details))
        self.sig_failed.emit(key, reason)

    def _end(self, key: str, download: _Download) -> None:
        self._active.pop(key, None)
        download.process.join(5)
        if download.process.is_alive():
            self._stop(download)

    @staticmethod
    def _stop(download: _Download) -> None:
        download.process.kill()
        download.process.join(5)
        download.events.cancel_join_thread()
        download.events.close()

    def _emit_progress(self, progress: DownloadProgress) -> None:
        self._states[progress.key] = progress
        self.sig_progress.emit(progress.key, progress)
