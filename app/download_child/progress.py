"""A download's progress as the picker shows it, and the silent progress bars that measure it.

`DownloadProgress` is what the child reports and the GUI renders (`describe()` is its one line);
`Reporter` throttles the child's reports; `ProgressBar` is the tqdm class huggingface_hub is
given: it draws nothing and tells the reporter how many bytes arrived.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass

import tqdm

from app.catalog import format_bytes, format_duration

PROGRESS_EVERY_S = 0.25
RATE_WINDOW_S = 5.0


class DownloadState(enum.Enum):
    CHECKING = "checking"
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def active(self) -> bool:
        return self in (DownloadState.CHECKING, DownloadState.DOWNLOADING, DownloadState.VERIFYING)


@dataclass(frozen=True)
class DownloadProgress:
    key: str  # the download's key (`ModelSource.key`): its repo id, or 'repo:QUANT'
    state: DownloadState
    bytes_done: int = 0
    bytes_total: int = 0
    speed_bps: float | None = None
    eta_s: float | None = None
    reason: str = ""  # why it failed: one sentence with what to do
    details: str = ""  # the technical account of a failure, behind "Details…"

    @property
    def fraction(self) -> float | None:
        return self.bytes_done / self.bytes_total if self.bytes_total else None

    def describe(self) -> str:
        """The one line the picker shows for this download."""
        match self.state:
            case DownloadState.CHECKING:
                return "Checking the files on the Hub…"
            case DownloadState.DOWNLOADING:
                parts = [f"Downloading {format_bytes(self.bytes_done)} of {format_bytes(self.bytes_total)}"]
                if self.speed_bps:
                    parts.append(f"{format_bytes(self.speed_bps)}/s")
                if self.eta_s is not None:
                    parts.append(f"{format_duration(self.eta_s)} left")
                return " · ".join(parts)
            case DownloadState.VERIFYING:
                share = f" {self.fraction:.0%}" if self.fraction is not None else ""
                return f"Verifying{share}…"
            case DownloadState.DONE:
                return "Downloaded and verified"
            case DownloadState.CANCELLED:
                return "Cancelled"
        return f"Failed: {self.reason}"


class RateMeter:
    """Bytes per second over the last few seconds, and the time left at that speed."""

    def __init__(self, window_s: float = RATE_WINDOW_S):
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, done: int) -> None:
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()

    def speed(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        return (b1 - b0) / (t1 - t0) if t1 - t0 >= 0.5 else None

    def eta(self, done: int, total: int) -> float | None:
        speed = self.speed()
        return (total - done) / speed if speed else None


class Reporter:
    """Sends throttled progress events to the parent."""

    def __init__(self, key: str, events):
        self.key, self.events = key, events
        self.state = DownloadState.CHECKING
        self.total = 0
        self.meter = RateMeter()
        self._last_sent = 0.0
        self._bars: dict[int, int] = {}
        ProgressBar.reporter = self

    def start(self, total: int) -> None:
        self.state, self.total = DownloadState.DOWNLOADING, total
        self._send(0, force=True)

    def verifying(self, total: int) -> None:
        if self._bars:  # the last bytes may have come within the throttle interval
            self._send(max(self._bars.values()), force=True)
        self.state, self.total = DownloadState.VERIFYING, total
        self._send(0, force=True)

    def verified(self, done: int) -> None:
        self._send(done)

    def bar_moved(self, bar_id: int, n: int) -> None:
        if self.state is DownloadState.DOWNLOADING:
            # snapshot_download feeds the same bytes to two bars (network and disk): take the larger
            self._bars[bar_id] = n
            self._send(max(self._bars.values()))

    def _send(self, done: int, force: bool = False) -> None:
        now = time.monotonic()
        self.meter.add(now, done)
        if not force and now - self._last_sent < PROGRESS_EVERY_S:
            return
        self._last_sent = now
        downloading = self.state is DownloadState.DOWNLOADING
        speed, eta = (self.meter.speed(), self.meter.eta(done, self.total)) if downloading else (None, None)
        shown = min(done, self.total) if self.total else done
        self.events.put(("progress", DownloadProgress(self.key, self.state, shown, self.total, speed, eta)))


class _Sink:
    """Where the silent progress bars write."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class ProgressBar(tqdm.tqdm):
    """A tqdm that draws nothing and tells the reporter how many bytes arrived."""

    reporter: Reporter | None = None

    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)  # huggingface_hub's own bars take a name; tqdm does not
        kwargs.update(file=_Sink(), disable=False)
        super().__init__(*args, **kwargs)

    def update(self, n=1):
        result = super().update(n)
        if self.unit == "B" and ProgressBar.reporter is not None:
            ProgressBar.reporter.bar_moved(id(self), int(self.n))
        return result
