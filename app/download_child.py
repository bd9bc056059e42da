"""What runs inside a download's child process (see `app.gui.downloads` for the whole story).

`run_download(job, events, go)` is the child's entry point. It reports through `events` (a
multiprocessing queue) as tuples: ("progress", DownloadProgress), ("planned", bytes_to_fetch),
("done", folder) or ("failed", reason). After "planned" it waits for the parent to set `go`
(the parent checks the free disk space; a download that does not fit is killed before any byte
of it is fetched).

A job fetches a whole model (config.json, safetensors, tokenizer) or only the chosen files of a
GGUF repo (`ModelSource.files`: one of its quants). A GGUF carries its own config and tokenizer:
no config.json is checked first, its header is checked after verification (`check_loadable`).

No Qt here, and huggingface_hub is imported only after HF_HUB_DISABLE_XET is set: the child
downloads over plain HTTP, whose progress the tqdm class below sees and which a kill stops.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import tqdm

from app.catalog import format_bytes, format_duration
from app.model_library import ModelSource

log = logging.getLogger(__name__)

ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.md", "LICENSE*")
# gpt-oss keeps duplicate weights in original/ and metal/; Mixtral ships consolidated *.pt copies.
IGNORE_PATTERNS = ("original/*", "metal/*", "*consolidated*")
PROGRESS_EVERY_S = 0.25
RATE_WINDOW_S = 5.0
GO_TIMEOUT_S = 600.0
HASH_CHUNK = 8 * 2**20
BROKEN_CONNECTION = ("RemoteProtocolError", "ReadError", "ReadTimeout")  # httpx's names


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
    reason: str = ""  # why it failed

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


@dataclass(frozen=True)
class DownloadJob:
    source: ModelSource
    revision: str
    target: str  # the folder the files go into
    endpoint: str | None = None
    token: str | None = None  # None: huggingface_hub's own (HF_TOKEN or its token file)

    @property
    def repo_id(self) -> str:
        return self.source.repo_id


@dataclass(frozen=True)
class PlannedFile:
    name: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git object id (verifies small, non-LFS files)
    will_download: bool


class DownloadError(Exception):
    """A failure whose message is meant for the user as it is."""


# -- the child's entry point ----------------------------------------------------------------------


def run_download(job: DownloadJob, events, go) -> None:
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    reporter = _Reporter(job.source.key, events)
    try:
        commit, files = plan_download(job)
        to_fetch = sum(f.size for f in files if f.will_download)
        events.put(("planned", to_fetch))
        if not go.wait(GO_TIMEOUT_S):
            raise DownloadError("the app did not answer; the download was stopped.")
        fetched_first = check_config(job, commit)
        reporter.start(total=sum(f.size for f in files if f.will_download and f.name not in fetched_first))
        fetch(job, commit)
        reporter.verifying(sum(f.size for f in files))
        verify_files(Path(job.target), files, reporter)
        check_loadable(job.source.path_in(Path(job.target)))
        events.put(("done", job.target))
    except BaseException as err:  # everything becomes a reason the user reads
        log.warning("Download of %s failed", job.repo_id, exc_info=True)
        events.put(("failed", describe_error(err, job)))


def plan_download(job: DownloadJob) -> tuple[str, list[PlannedFile]]:
    """The commit, and every file to have with its size and hashes; metadata requests only."""
    from huggingface_hub import HfApi, RepoFile, snapshot_download

    dry_run = snapshot_download(
        job.repo_id, revision=job.revision, **_common_args(job), dry_run=True, tqdm_class=_ProgressBar
    )
    chosen = job.source.files
    missing = sorted(set(chosen) - {info.filename for info in dry_run})
    if not dry_run or missing:
        what = f"{', '.join(missing)}: renamed or removed" if chosen else "config.json, *.safetensors"
        raise DownloadError(f"{job.repo_id} has no model files ({what}).")
    commit = dry_run[0].commit_hash
    api = HfApi(endpoint=job.endpoint, token=job.token)
    tree = api.list_repo_tree(job.repo_id, recursive=True, revision=commit)
    listing = {f.path: f for f in tree if isinstance(f, RepoFile)}
    files = []
    for info in dry_run:
        entry = listing.get(info.filename)
        if entry is None:
            raise DownloadError(f"{info.filename} is missing from the Hub's listing of {job.repo_id}.")
        sha256 = entry.lfs.sha256 if entry.lfs else None
        blob_id = None if entry.lfs else entry.blob_id
        files.append(PlannedFile(info.filename, entry.size, sha256, blob_id, info.will_download))
    if not chosen and "config.json" not in listing:
        raise DownloadError(f"{job.repo_id} has no config.json; it is not a transformers model.")
    return commit, sorted(files, key=lambda f: f.name)


def _common_args(job: DownloadJob) -> dict:
    target = Path(job.target)
    chosen = job.source.files  # exact names: fnmatch finds only themselves (no [ in a GGUF's name)
    return {
        "local_dir": target,
        # the refs snapshot_download keeps go inside the download, not into the user's HF cache
        "cache_dir": target / ".cache" / "huggingface" / "hub",
        "endpoint": job.endpoint,
        "token": job.token,
        "allow_patterns": list(chosen or ALLOW_PATTERNS),
        "ignore_patterns": [] if chosen else list(IGNORE_PATTERNS),
    }


def check_config(job: DownloadJob, commit: str) -> set[str]:
    """Fetch config.json first: an unsupported or pre-quantized model is refused before its weights.
    The names fetched; none for chosen GGUF files (their header is checked once they are here)."""
    from huggingface_hub import hf_hub_download

    from engine.model.check import config_problems

    if job.source.files:
        return set()

    common = _common_args(job)
    path = hf_hub_download(
        job.repo_id,
        "config.json",
        revision=commit,
        **{key: common[key] for key in ("local_dir", "cache_dir", "endpoint", "token")},
        tqdm_class=_ProgressBar,
    )
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DownloadError(f"the config.json of {job.repo_id} is not valid JSON ({err}).") from err
    problems = config_problems(config if isinstance(config, dict) else {})
    if problems:
        raise DownloadError(f"MoE Chat cannot run {job.repo_id}: {problems[0]}")
    return {"config.json"}


def fetch(job: DownloadJob, commit: str) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(job.repo_id, revision=commit, **_common_args(job), tqdm_class=_ProgressBar)


def verify_files(folder: Path, files: list[PlannedFile], reporter: _Reporter) -> None:
    """Size and hash of every file against the Hub's listing; bad files are removed."""
    bad: list[str] = []
    done = 0
    for planned in files:
        path = folder / planned.name
        problem = _file_problem(path, planned, lambda n, base=done: reporter.verified(base + n))
        done += planned.size
        reporter.verified(done)
        if problem:
            bad.append(problem)
            path.unlink(missing_ok=True)
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise DownloadError(
            f"verification: {'; '.join(bad[:3])}{more}. "
            "The bad file(s) were removed; Retry fetches them again."
        )


def _file_problem(path: Path, planned: PlannedFile, progress) -> str | None:
    if not path.is_file():
        return f"{planned.name} is missing"
    size = path.stat().st_size
    if size != planned.size:
        return f"{planned.name} has {size} bytes, the Hub lists {planned.size}"
    if planned.sha256:
        digest, expected, kind = hashlib.sha256(), planned.sha256, "sha256"
    elif planned.blob_id:
        digest, expected, kind = hashlib.sha1(b"blob %d\0" % size), planned.blob_id, "git blob id"
    else:
        return None
    read = 0
    with path.open("rb") as stream:
        while chunk := stream.read(HASH_CHUNK):
            digest.update(chunk)
            read += len(chunk)
            progress(read)
    if digest.hexdigest() != expected:
        return f"{planned.name} does not match its {kind} on the Hub"
    return None


def check_loadable(path: Path) -> None:
    """The engine's own check: safetensors headers against the index, or the GGUF header."""
    from engine.model.check import check_model_folder

    check = check_model_folder(path)
    if not check.ok:
        raise DownloadError(f"downloaded, but MoE Chat cannot load it: {check.problems[0]}")


def describe_error(err: BaseException, job: DownloadJob) -> str:
    """A failure in words the user can act on."""
    from huggingface_hub import errors

    chain = []
    while err is not None and len(chain) < 8:
        chain.append(err)
        err = err.__cause__ or err.__context__
    for cause in chain:
        if isinstance(cause, DownloadError):
            return str(cause)
        if isinstance(cause, errors.GatedRepoError):
            page = f"https://huggingface.co/{job.repo_id}"
            return f"{job.repo_id} is gated: accept its terms at {page}, then set a Hugging Face token."
        if isinstance(cause, errors.RevisionNotFoundError):
            return f"{job.repo_id} has no revision {job.revision!r} on the Hub."
        if isinstance(cause, errors.RepositoryNotFoundError):
            return f"{job.repo_id} is not on the Hub (or it is private and needs a token)."
        if isinstance(cause, errors.OfflineModeIsEnabled):
            return "Offline mode is on (HF_HUB_OFFLINE is set); unset it to download."
    first = chain[0]
    name = type(first).__name__
    if "Consistency check failed" in str(first) or name in BROKEN_CONNECTION:
        return f"the connection to the Hub broke off during the download ({name}). Retry to continue."
    if name in ("ConnectError", "ConnectTimeout", "LocalEntryNotFoundError"):
        return f"cannot reach the Hub ({job.endpoint or 'huggingface.co'}): check the internet connection."
    if isinstance(first, OSError) and first.errno == 28:
        return "the disk is full. Free some space, then Retry."
    return f"{name}: {first}"


# -- progress ------------------------------------------------------------------------------------


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


class _Reporter:
    """Sends throttled progress events to the parent."""

    def __init__(self, key: str, events):
        self.key, self.events = key, events
        self.state = DownloadState.CHECKING
        self.total = 0
        self.meter = RateMeter()
        self._last_sent = 0.0
        self._bars: dict[int, int] = {}
        _ProgressBar.reporter = self

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


class _ProgressBar(tqdm.tqdm):
    """A tqdm that draws nothing and tells the reporter how many bytes arrived."""

    reporter: _Reporter | None = None

    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)  # huggingface_hub's own bars take a name; tqdm does not
        kwargs.update(file=_Sink(), disable=False)
        super().__init__(*args, **kwargs)

    def update(self, n=1):
        result = super().update(n)
        if self.unit == "B" and _ProgressBar.reporter is not None:
            _ProgressBar.reporter.bar_moved(id(self), int(self.n))
        return result
