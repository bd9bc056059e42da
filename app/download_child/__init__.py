"""What runs inside a download's child process (see `app.gui.models.downloads` for the whole story).

`run_download(job, events, go)` is the child's entry point. It reports through `events` (a
multiprocessing queue) as tuples: ("progress", DownloadProgress), ("planned", bytes_to_fetch),
("log", level, logger, message), ("done", folder) or ("failed", reason, details). After
"planned" it waits for the parent to set `go` (the parent checks the free disk space; a download
that does not fit is killed before any byte of it is fetched).

A failure is one sentence for the user and its technical details (`hub_errors.explain`); the
child prints nothing: its log records travel to the parent as "log" events, so nothing lands on
the console but the parent's own handlers decide. Before anything else the child checks that
the Hub answers at all (`hub_errors.check_reachable`), so offline is said in a second or two,
not after huggingface_hub's retries.

A job fetches a whole model (config.json, safetensors, tokenizer) or only the chosen files of a
GGUF repo (`ModelSource.files`: one of its quants). A GGUF carries its own config and tokenizer:
no config.json is checked first, its header is checked after verification (`check_loadable`).

No Qt here, and huggingface_hub is imported only after HF_HUB_DISABLE_XET is set: the child
downloads over plain HTTP, whose progress the tqdm class in `progress` sees and which a kill stops.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from app.download_child.hub_errors import DownloadError, HubError, check_reachable, explain, quiet_hub_logging
from app.download_child.progress import DownloadProgress, DownloadState, ProgressBar, RateMeter, Reporter
from app.model_library import ModelSource

__all__ = [
    "DownloadError",
    "DownloadJob",
    "DownloadProgress",
    "DownloadState",
    "HubError",
    "RateMeter",
    "run_download",
]

log = logging.getLogger(__name__)

ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.md", "LICENSE*")
# gpt-oss keeps duplicate weights in original/ and metal/; Mixtral ships consolidated *.pt copies.
IGNORE_PATTERNS = ("original/*", "metal/*", "*consolidated*")
GO_TIMEOUT_S = 600.0
HASH_CHUNK = 8 * 2**20


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


# -- the child's entry point ----------------------------------------------------------------------


def run_download(job: DownloadJob, events, go) -> None:
    """The child process's entry point: set up, then `download`."""
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    _send_logs_to_parent(events)
    download(job, events, go)


def download(job: DownloadJob, events, go) -> None:
    """Check, plan, fetch and verify `job`, reporting through `events`; never raises."""
    quiet_hub_logging()
    reporter = Reporter(job.source.key, events)
    try:
        check_reachable(job.endpoint)
        commit, files = plan_download(job)
        to_fetch = sum(f.size for f in files if f.will_download)
        events.put(("planned", to_fetch))
        if not go.wait(GO_TIMEOUT_S):
            raise DownloadError("The app did not answer, so the download was stopped: try again.")
        fetched_first = check_config(job, commit)
        reporter.start(total=sum(f.size for f in files if f.will_download and f.name not in fetched_first))
        fetch(job, commit)
        reporter.verifying(sum(f.size for f in files))
        verify_files(Path(job.target), files, reporter)
        check_loadable(job.source.path_in(Path(job.target)))
        events.put(("done", job.target))
    except BaseException as err:  # everything becomes a sentence the user reads, with its details
        failure = explain(err, job.repo_id, job.endpoint, job.revision)
        events.put(("failed", failure.message, failure.details))


class _ParentHandler(logging.Handler):
    """Sends the child's log records to the parent, which logs them with its own handlers."""

    def __init__(self, events):
        super().__init__(logging.DEBUG)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.events.put(("log", record.levelno, record.name, record.getMessage()))
        except Exception:  # a closed queue: the parent is gone, nobody reads the record
            self.handleError(record)


def _send_logs_to_parent(events) -> None:
    root = logging.getLogger()
    root.handlers[:] = [_ParentHandler(events)]
    root.setLevel(logging.INFO)


def plan_download(job: DownloadJob) -> tuple[str, list[PlannedFile]]:
    """The commit, and every file to have with its size and hashes; metadata requests only."""
    from huggingface_hub import HfApi, RepoFile, snapshot_download

    dry_run = snapshot_download(
        job.repo_id, revision=job.revision, **_common_args(job), dry_run=True, tqdm_class=ProgressBar
    )
    chosen = job.source.files
    missing = sorted(set(chosen) - {info.filename for info in dry_run})
    if not dry_run or missing:
        what = f"{', '.join(missing)}: renamed or removed" if chosen else "config.json, *.safetensors"
        raise DownloadError(f"{job.repo_id} has no model files ({what}): choose another model.")
    commit = dry_run[0].commit_hash
    api = HfApi(endpoint=job.endpoint, token=job.token)
    tree = api.list_repo_tree(job.repo_id, recursive=True, revision=commit)
    listing = {f.path: f for f in tree if isinstance(f, RepoFile)}
    files = []
    for info in dry_run:
        entry = listing.get(info.filename)
        if entry is None:
            missing = f"{info.filename} is missing from the Hub's listing of {job.repo_id}"
            raise DownloadError(f"{missing}: try again later.")
        sha256 = entry.lfs.sha256 if entry.lfs else None
        blob_id = None if entry.lfs else entry.blob_id
        files.append(PlannedFile(info.filename, entry.size, sha256, blob_id, info.will_download))
    if not chosen and "config.json" not in listing:
        raise DownloadError(f"{job.repo_id} has no config.json, so MoE Chat cannot run it: choose another.")
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
        tqdm_class=ProgressBar,
    )
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        bad = f"The config.json of {job.repo_id} is not valid JSON ({err})"
        raise DownloadError(f"{bad}: choose another model.") from err
    problems = config_problems(config if isinstance(config, dict) else {})
    if problems:
        raise DownloadError(f"MoE Chat cannot run {job.repo_id}: {problems[0]}")
    return {"config.json"}


def fetch(job: DownloadJob, commit: str) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(job.repo_id, revision=commit, **_common_args(job), tqdm_class=ProgressBar)


def verify_files(folder: Path, files: list[PlannedFile], reporter: Reporter) -> None:
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
            f"Verification failed ({'; '.join(bad[:3])}{more}): the bad files were removed, "
            "and Retry fetches them again."
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
        raise DownloadError(f"Downloaded, but MoE Chat cannot load it: {check.problems[0]}")
