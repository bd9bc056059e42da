"""Downloads against a local fake Hub: what the user sees in each scenario, and what is on disk;
a GGUF quant fetches only its own file(s) of a repo holding several."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import psutil
import pytest

import app.gui.models.downloads as downloads
import app.gui.models.hub_client as hub_client
from app.download_child import DownloadProgress, DownloadState, RateMeter
from app.gui.models.downloads import DownloadManager
from app.gui.models.hub_client import search_models
from app.model_library import PARTIAL_MARKER, ModelLibrary, ModelSource
from engine.tiny.gguf_writer import write_split_gguf, write_tiny_gguf
from engine.tiny.models import make_tiny_model
from tests.app.fake_hub import FakeHub, FakeRepo

REPO = "tiny-org/tiny-moe"
WEIGHTS = "model.safetensors"
TIMEOUT_MS = 60_000
GGUF_REPO = "gguf-org/tiny-moe-GGUF"
Q4 = ModelSource(GGUF_REPO, ("tiny-moe-Q4_K_M.gguf",), "Q4_K_M")
SPLIT_Q8 = ModelSource(
    GGUF_REPO, ("Q8_0/tiny-moe-Q8_0-00001-of-00002.gguf", "Q8_0/tiny-moe-Q8_0-00002-of-00002.gguf"), "Q8_0"
)

pytestmark = [pytest.mark.gui, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, bytes]:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "qwen3_moe")
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def gguf_repo_files(tmp_path_factory) -> dict[str, bytes]:
    """A GGUF repo as publishers lay them out: one file per quant, a big quant split in a subfolder."""
    single = write_tiny_gguf(tmp_path_factory.mktemp("gguf"), "qwen3_moe")
    single_bytes = single.read_bytes()
    parts = [path.read_bytes() for path in write_split_gguf(single, 2)]
    return {
        Q4.files[0]: single_bytes,
        "tiny-moe-Q6_K.gguf": b"GGUF" + bytes(3 * 2**20),  # never fetched
        SPLIT_Q8.files[0]: parts[0],
        SPLIT_Q8.files[1]: parts[1],
        "README.md": b"# tiny-moe GGUF\n",
    }


@pytest.fixture
def hub(model_files, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the spawned child inherits this environment
    with FakeHub() as server:
        server.add_repo(FakeRepo(REPO, dict(model_files)))
        yield server


@pytest.fixture
def library(tmp_path) -> ModelLibrary:
    return ModelLibrary(tmp_path / "models")


@pytest.fixture
def manager(qtbot, hub, library, monkeypatch):
    monkeypatch.setattr(downloads, "load_token", lambda: None)  # never a real token of this machine
    manager = make_manager(hub, library)
    yield manager
    manager.shutdown()


def make_manager(hub, library) -> DownloadManager:
    """A manager that records every signal it sends in `manager.outcomes` and `manager.seen`."""
    manager = DownloadManager(library=library, endpoint=hub.url, poll_ms=30)
    manager.seen, manager.outcomes = [], []
    manager.sig_progress.connect(lambda repo_id, progress: manager.seen.append(progress))
    manager.sig_finished.connect(lambda repo_id, folder: manager.outcomes.append(("finished", folder)))
    manager.sig_failed.connect(lambda repo_id, reason: manager.outcomes.append(("failed", reason)))
    manager.sig_cancelled.connect(lambda repo_id: manager.outcomes.append(("cancelled", repo_id)))
    return manager


def download(qtbot, manager, what: str | ModelSource = REPO, retry: bool = False) -> tuple[str, str]:
    """Start (or retry) a download and wait for its end: ("finished", path) or ("failed", reason)."""
    key = what.key if isinstance(what, ModelSource) else what
    before = len(manager.outcomes)
    manager.retry(key) if retry else manager.start(what)
    qtbot.waitUntil(lambda: len(manager.outcomes) > before, timeout=TIMEOUT_MS)
    assert not manager.is_active(key)
    return manager.outcomes[-1]


def states(manager) -> list[DownloadState]:
    """The states the user saw, each once, in order."""
    order: list[DownloadState] = []
    for progress in manager.seen:
        if not order or order[-1] is not progress.state:
            order.append(progress.state)
    return order


def assert_installed(folder: Path, model_files: dict[str, bytes]) -> None:
    files = {p.name for p in folder.iterdir() if p.is_file()}
    assert files == set(model_files)
    for name, data in model_files.items():
        assert hashlib.sha256((folder / name).read_bytes()).digest() == hashlib.sha256(data).digest()


def test_a_download_shows_each_state_and_leaves_a_verified_model(
    qtbot, manager, library, model_files, hub, capfd
):
    outcome, folder = download(qtbot, manager)
    assert outcome == "finished" and Path(folder) == library.folder_for(REPO)
    assert states(manager) == [
        DownloadState.CHECKING,
        DownloadState.DOWNLOADING,
        DownloadState.VERIFYING,
        DownloadState.DONE,
    ]
    downloading = [p for p in manager.seen if p.state is DownloadState.DOWNLOADING]
    total = sum(len(d) for name, d in model_files.items() if name != "config.json")  # fetched while checking
    assert downloading[0].bytes_total == total and downloading[-1].bytes_done == total
    assert manager.state(REPO).describe() == "Downloaded and verified"
    assert_installed(Path(folder), model_files)
    assert not (Path(folder) / PARTIAL_MARKER).exists()
    assert library.is_installed(REPO) and library.find(REPO).source == "downloaded"
    assert len(hub.file_gets(REPO)) == len(model_files)  # each file fetched once
    assert capfd.readouterr().err == ""  # the child prints nothing


def test_cancel_kills_the_child_removes_the_partial_files_and_retry_works(
    qtbot, manager, library, model_files, hub
):
    hub.faults.bytes_per_s = 100_000  # the weights take several seconds
    manager.start(REPO)
    qtbot.waitUntil(
        lambda: hub.bytes_sent.get(WEIGHTS, 0) > 0 and manager.state(REPO).state is DownloadState.DOWNLOADING,
        timeout=TIMEOUT_MS,
    )
    pid = manager.pid(REPO)
    assert psutil.pid_exists(pid)
    assert library.has_partial(REPO)
    manager.cancel(REPO)
    assert manager.outcomes == [("cancelled", REPO)]
    assert not psutil.pid_exists(pid)
    assert manager.state(REPO).describe() == "Cancelled"
    assert not library.folder_for(REPO).exists()
    assert not library.is_installed(REPO)

    hub.faults.bytes_per_s = None
    outcome, folder = download(qtbot, manager, retry=True)
    assert outcome == "finished"
    assert_installed(Path(folder), model_files)


def test_a_broken_connection_fails_with_a_reason_and_retry_succeeds(
    qtbot, manager, library, model_files, hub, capfd, caplog
):
    hub.faults.break_after[WEIGHTS] = 50_000  # every attempt at the weights stops there
    with caplog.at_level("DEBUG", logger="app.gui.models.downloads"):
        outcome, reason = download(qtbot, manager)
    assert outcome == "failed"
    assert reason == f"The connection to the Hub at {hub.url.removeprefix('http://')} broke off: try again."
    assert manager.state(REPO).state is DownloadState.FAILED
    assert manager.state(REPO).describe() == f"Failed: {reason}"
    assert "Traceback" in manager.state(REPO).details
    warnings = [
        r for r in caplog.records if r.levelname == "WARNING" and r.name == "app.gui.models.downloads"
    ]
    assert [r.getMessage() for r in warnings] == [f"Download of {REPO} failed: {reason}"]
    assert not any(r.exc_info for r in warnings)  # the traceback is in the debug record (the file)
    assert any("Traceback" in r.getMessage() for r in caplog.records if r.levelname == "DEBUG")
    assert capfd.readouterr().err == ""
    assert not list(library.folder_for(REPO).rglob("*.incomplete"))
    assert not library.is_installed(REPO)

    hub.faults.break_after.clear()
    outcome, folder = download(qtbot, manager, retry=True)
    assert outcome == "finished"
    assert_installed(Path(folder), model_files)


def test_a_child_that_dies_is_reported_as_failed(qtbot, manager, library, hub):
    hub.faults.bytes_per_s = 50_000
    manager.start(REPO)
    qtbot.waitUntil(lambda: hub.bytes_sent.get(WEIGHTS, 0) > 0, timeout=TIMEOUT_MS)
    psutil.Process(manager.pid(REPO)).kill()
    qtbot.waitUntil(lambda: bool(manager.outcomes), timeout=TIMEOUT_MS)
    [(outcome, reason)] = manager.outcomes
    assert outcome == "failed"
    assert reason.startswith("The download stopped unexpectedly (its process exited with code ")
    assert library.has_partial(REPO) and not library.is_installed(REPO)


def test_not_enough_disk_space_fails_before_any_byte_is_fetched(qtbot, manager, hub, monkeypatch):
    monkeypatch.setattr(downloads, "disk_free_bytes", lambda path: 1000)
    outcome, reason = download(qtbot, manager)
    assert outcome == "failed"
    assert reason.startswith("Not enough disk space: ") and ", 1000 B free on " in reason
    assert reason.endswith("; free some space, then try again.")
    assert hub.file_gets(REPO) == []
    assert states(manager) == [DownloadState.CHECKING, DownloadState.FAILED]


@pytest.mark.parametrize(
    ("name", "expected"),
    [(WEIGHTS, "does not match its sha256"), ("tokenizer.json", "bytes, the Hub lists")],
)
def test_bytes_that_differ_from_the_listing_fail_verification_and_are_removed(
    qtbot, manager, library, model_files, hub, name, expected
):
    good = model_files[name]
    hub.faults.wrong_bytes[name] = bytes([good[0] ^ 0xFF]) + good[1:] if name == WEIGHTS else good + b" "
    outcome, reason = download(qtbot, manager)
    assert outcome == "failed"
    assert reason.startswith("Verification failed (") and expected in reason
    assert manager.state(REPO).describe().startswith("Failed: Verification failed (")
    assert not (library.folder_for(REPO) / name).exists()
    assert not library.is_installed(REPO)

    hub.faults.wrong_bytes.clear()
    outcome, folder = download(qtbot, manager, retry=True)
    assert outcome == "finished"
    assert_installed(Path(folder), model_files)
    assert sum(p.endswith("/" + name) for p in hub.file_gets(REPO)) == 2  # only the bad file again


def test_an_unsupported_model_is_refused_before_its_weights(qtbot, manager, model_files, hub):
    files = dict(model_files, **{"config.json": b'{"model_type": "llama"}'})
    hub.add_repo(FakeRepo("dense/llama", files, model_type="llama"))
    outcome, reason = download(qtbot, manager, "dense/llama")
    assert outcome == "failed"
    assert "Architecture 'llama' is not supported" in reason
    assert [p.rsplit("/", 1)[1] for p in hub.file_gets("dense/llama")] == ["config.json"]


def fetched(hub, repo_id: str) -> list[str]:
    """The names of the files whose bytes were asked for."""
    return [path.split("/resolve/", 1)[1].split("/", 1)[1] for path in hub.file_gets(repo_id)]


def test_a_gguf_quant_fetches_only_its_own_file(qtbot, manager, library, hub, gguf_repo_files):
    hub.add_repo(FakeRepo(GGUF_REPO, dict(gguf_repo_files)))
    outcome, path = download(qtbot, manager, Q4)
    assert outcome == "finished" and Path(path) == library.folder_for("gguf-org/tiny-moe-GGUF:Q4_K_M")
    assert fetched(hub, GGUF_REPO) == [Q4.files[0]]
    assert {p.name for p in Path(path).iterdir() if p.is_file()} == {Q4.files[0]}
    assert (Path(path) / Q4.files[0]).read_bytes() == gguf_repo_files[Q4.files[0]]
    assert states(manager) == [
        DownloadState.CHECKING,
        DownloadState.DOWNLOADING,
        DownloadState.VERIFYING,
        DownloadState.DONE,
    ]
    downloading = [p for p in manager.seen if p.state is DownloadState.DOWNLOADING]
    assert downloading[0].bytes_total == len(gguf_repo_files[Q4.files[0]])  # planned: this file alone
    assert all(p.key == Q4.key for p in manager.seen)
    assert library.find(Q4.key).path == path and not library.is_installed(GGUF_REPO)
    assert not library.is_installed(SPLIT_Q8.key)


def test_a_split_gguf_set_in_a_subfolder_comes_whole_into_its_own_folder(
    qtbot, manager, library, hub, gguf_repo_files
):
    hub.add_repo(FakeRepo(GGUF_REPO, dict(gguf_repo_files)))
    outcome, path = download(qtbot, manager, SPLIT_Q8)
    assert outcome == "finished"
    folder = library.folder_for(SPLIT_Q8.key)
    assert Path(path) == folder / SPLIT_Q8.files[0]  # what the engine's --model takes
    assert sorted(fetched(hub, GGUF_REPO)) == list(SPLIT_Q8.files)
    assert library.installed_path(SPLIT_Q8.key) == Path(path)
    assert not library.folder_for(Q4.key).exists()


def test_a_gguf_download_that_cannot_load_or_is_gone_fails_with_the_reason(
    qtbot, manager, library, hub, gguf_repo_files
):
    broken = dict(gguf_repo_files, **{Q4.files[0]: b"GGUF" + bytes(5000)})
    hub.add_repo(FakeRepo(GGUF_REPO, broken))
    outcome, reason = download(qtbot, manager, Q4)
    assert outcome == "failed"
    assert reason.startswith("Downloaded, but MoE Chat cannot load it: ") and "GGUF" in reason
    assert not library.is_installed(Q4.key)

    gone = ModelSource(GGUF_REPO, ("tiny-moe-Q5_K_M.gguf",), "Q5_K_M")
    outcome, reason = download(qtbot, manager, gone)
    assert outcome == "failed"
    expected = (
        f"{GGUF_REPO} has no model files (tiny-moe-Q5_K_M.gguf: renamed or removed): choose another model."
    )
    assert reason == expected
    assert fetched(hub, GGUF_REPO) == [Q4.files[0]]  # nothing of the second


def test_a_gated_model_needs_the_stored_token(qtbot, hub, library, model_files, memory_keyring, capfd):
    hub.add_repo(FakeRepo("gated/moe", dict(model_files), gated=True, token="hf_secret"))
    manager = make_manager(hub, library)
    try:
        outcome, reason = download(qtbot, manager, "gated/moe")
        assert outcome == "failed"
        assert reason == (
            "gated/moe is gated: accept its terms at https://huggingface.co/gated/moe, "
            "then set a Hugging Face token."
        )
        assert capfd.readouterr().err == ""

        assert hub_client.store_token(" hf_secret\n") == "the system keyring"
        assert memory_keyring.passwords[("moe-chat", "huggingface")] == "hf_secret"
        assert hub_client.load_token() == "hf_secret"
        assert download(qtbot, manager, "gated/moe", retry=True)[0] == "finished"
    finally:
        manager.shutdown()


def test_without_a_keyring_the_token_goes_to_huggingface_hub(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(hub_client, "_keyring", lambda: None)
    logins = []
    monkeypatch.setattr(huggingface_hub, "login", lambda token, **kw: logins.append(token))
    assert hub_client.store_token("hf_abc") == "huggingface_hub's token file"
    assert logins == ["hf_abc"]
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert hub_client.load_token() == "hf_from_env"
    with pytest.raises(ValueError, match="empty"):
        hub_client.store_token("  ")


def test_search_lists_only_supported_architectures_most_downloaded_first(hub, model_files, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # imported under conftest's "1"
    monkeypatch.setattr(hub_client, "load_token", lambda: None)
    hub.add_repo(FakeRepo("a/mixtral-moe", {}, model_type="mixtral", downloads=50))
    hub.add_repo(FakeRepo("b/llama-dense", {}, model_type="llama", downloads=999))
    hub.add_repo(FakeRepo("c/qwen-moe-gated", {}, model_type="qwen3_moe", downloads=70, gated=True))
    remote_code = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {"AutoConfig": "c.DeepseekV3Config"},
    }
    hub.add_repo(FakeRepo("d/kimi-moe", {}, model_type="kimi_k2", downloads=40, config=remote_code))
    found = search_models("moe", endpoint=hub.url)
    listed = ["c/qwen-moe-gated", "a/mixtral-moe", "d/kimi-moe", "tiny-org/tiny-moe"]
    assert [m.repo_id for m in found] == listed
    assert found[0].architecture == "qwen3_moe" and found[0].gated and not found[1].gated
    assert found[2].architecture == "deepseek_v3" and not found[2].quantized  # loads as its base family
    assert search_models("moe", limit=1, endpoint=hub.url)[0].repo_id == "c/qwen-moe-gated"


def test_progress_lines_say_what_is_happening():
    progress = DownloadProgress("o/m", DownloadState.DOWNLOADING, 3 * 2**30, 12 * 2**30, 50 * 2**20, 184)
    assert progress.describe() == "Downloading 3.0 GiB of 12.0 GiB · 50.0 MiB/s · 3 min 04 s left"
    assert DownloadProgress("o/m", DownloadState.VERIFYING, 1, 4).describe() == "Verifying 25%…"
    failed = DownloadProgress("o/m", DownloadState.FAILED, reason="not enough disk space: need 2 GiB")
    assert failed.describe() == "Failed: not enough disk space: need 2 GiB"


def test_the_rate_meter_averages_over_its_window():
    meter = RateMeter(window_s=5.0)
    assert meter.speed() is None
    start = time.monotonic()
    for second in range(10):
        meter.add(start + second, second * 1000)
    assert meter.speed() == pytest.approx(1000)
    assert meter.eta(9000, 19000) == pytest.approx(10)


def test_offline_a_download_fails_at_once_in_one_sentence_and_prints_nothing(qtbot, library, capfd):
    manager = DownloadManager(library=library, endpoint="http://no-such-hub.invalid", poll_ms=30)
    outcomes = []
    manager.sig_failed.connect(lambda key, reason: outcomes.append(reason))
    try:
        manager.start(REPO)
        started = time.monotonic()
        qtbot.waitUntil(lambda: bool(outcomes), timeout=TIMEOUT_MS)
        # the child's start (a spawned interpreter importing the app) comes on top of the 2 s probe
        assert time.monotonic() - started < 20
    finally:
        manager.shutdown()
    assert outcomes == [
        "This computer seems to be offline (the Hub at no-such-hub.invalid cannot be reached): "
        "check the internet connection, then try again."
    ]
    assert "gaierror" in manager.state(REPO).details
    assert capfd.readouterr().err == ""
