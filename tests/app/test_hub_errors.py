"""Every failure a download or a search can be expected to meet is one sentence with what to do,
its details apart, fast, and nothing on the console.

The download runs in this process (`app.download_child.download`, what the child runs after its
set-up) against the local fake Hub, one test per kind of failure; `test_downloads.py` runs it in
the real child process.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

import pytest

import app.download_child as download_child
import app.gui.models.hub_client as hub_client
from app.download_child import DownloadJob
from app.download_child.hub_errors import HubError, check_reachable, explain
from app.model_library import ModelSource
from tests.app.fake_hub import FakeHub, FakeRepo

REPO = "tiny-org/tiny-moe-GGUF"
GGUF = ModelSource(REPO, ("tiny-moe-Q4_K_M.gguf",), "Q4_K_M")
OFFLINE_BOUND_S = 3.0


class Events:
    """What the child would have sent to the parent."""

    def __init__(self):
        self.sent: list[tuple] = []

    def put(self, event: tuple) -> None:
        self.sent.append(event)

    def failure(self) -> tuple[str, str]:
        [(_, reason, details)] = [e for e in self.sent if e[0] == "failed"]
        return reason, details


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # conftest imported it offline
    monkeypatch.setattr(hub_client, "load_token", lambda: None)
    with FakeHub() as server:
        server.add_repo(FakeRepo(REPO, {GGUF.files[0]: b"GGUF" + bytes(200_000), "README.md": b"#"}))
        yield server


def failed_download(tmp_path, endpoint: str, source: ModelSource = GGUF, token: str | None = None):
    """Run a download to its failure: (reason, details, seconds)."""
    go = threading.Event()
    go.set()
    events = Events()
    job = DownloadJob(source, "main", str(tmp_path / "target"), endpoint, token)
    start = time.monotonic()
    download_child.download(job, events, go)
    reason, details = events.failure()
    return reason, details, time.monotonic() - start


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def silent_server():
    """A port whose listen queue is full: a connection to it is never answered."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(server.getsockname())
        fillers.append(filler)
    time.sleep(0.1)
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    for sock in (*fillers, server):
        sock.close()


def assert_quiet(capfd) -> None:
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_offline_is_said_at_once_for_a_download_and_a_search(tmp_path, capfd, hub):
    reason, details, seconds = failed_download(tmp_path, "http://no-such-hub.invalid")
    expected = (
        "This computer seems to be offline (the Hub at no-such-hub.invalid cannot be reached): "
        "check the internet connection, then try again."
    )
    assert reason == expected and seconds < OFFLINE_BOUND_S
    assert "gaierror" in details
    start = time.monotonic()
    with pytest.raises(HubError) as caught:
        hub_client.search_models("qwen", endpoint="http://no-such-hub.invalid")
    assert str(caught.value) == expected and time.monotonic() - start < OFFLINE_BOUND_S
    assert caught.value.failure.kind == "offline"
    assert_quiet(capfd)


def test_a_refused_connection(tmp_path, capfd):
    port = closed_port()
    reason, details, seconds = failed_download(tmp_path, f"http://127.0.0.1:{port}")
    assert reason == (
        f"The Hub at 127.0.0.1:{port} refused the connection: check the Hub address (HF_ENDPOINT) or "
        "the proxy settings, then try again."
    )
    assert "ConnectionRefusedError" in details and seconds < OFFLINE_BOUND_S
    assert_quiet(capfd)


def test_a_hub_that_never_answers_times_out_within_the_bound(tmp_path, capfd, silent_server):
    reason, _, seconds = failed_download(tmp_path, silent_server)
    host = silent_server.removeprefix("http://")
    assert (
        reason == f"The Hub at {host} did not answer in time: check the internet connection, then try again."
    )
    assert seconds < OFFLINE_BOUND_S
    start = time.monotonic()
    with pytest.raises(HubError, match="did not answer in time"):
        hub_client.search_models("qwen", endpoint=silent_server)
    assert time.monotonic() - start < OFFLINE_BOUND_S
    assert_quiet(capfd)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (
            401,
            "The Hub did not accept the Hugging Face token (HTTP 401): set a valid one with "
            "“Hugging Face token…”, then try again.",
        ),
        (
            403,
            f"The Hub refused access to {REPO} (HTTP 403): set a token that may read it with "
            "“Hugging Face token…”, then try again.",
        ),
        (404, f"{REPO} is not on the Hub: check its name (a private model needs a Hugging Face token)."),
        (
            429,
            "The Hub is limiting requests from this computer (HTTP 429): wait a few minutes, then try again.",
        ),
        (503, "The Hub had a problem (HTTP 503): try again in a few minutes."),
    ],
)
def test_http_errors(tmp_path, capfd, hub, status, expected):
    hub.faults.status = status
    reason, details, _ = failed_download(tmp_path, hub.url, token="hf_wrong")
    assert reason == expected
    assert f"{status}" in details and "Traceback" in details
    assert_quiet(capfd)


def test_a_gated_repo_without_a_token(tmp_path, capfd, hub):
    hub.repos[REPO].gated, hub.repos[REPO].token = True, "hf_right"
    reason, _, _ = failed_download(tmp_path, hub.url)
    assert reason == (
        f"{REPO} is gated: accept its terms at https://huggingface.co/{REPO}, then set a Hugging Face token."
    )
    assert_quiet(capfd)


def test_dropped_connections(tmp_path, capfd, hub):
    hub.faults.drop_connections = True
    reason, details, seconds = failed_download(tmp_path, hub.url)
    assert reason == f"The connection to the Hub at {hub.url.removeprefix('http://')} broke off: try again."
    assert "RemoteProtocolError" in details and seconds < OFFLINE_BOUND_S
    assert_quiet(capfd)


def test_a_connection_that_breaks_off_during_the_file(tmp_path, capfd, hub):
    hub.faults.break_after[GGUF.files[0]] = 50_000
    reason, _, _ = failed_download(tmp_path, hub.url)
    assert reason == f"The connection to the Hub at {hub.url.removeprefix('http://')} broke off: try again."
    assert_quiet(capfd)


def test_a_full_disk(tmp_path, capfd, hub, monkeypatch):
    def no_space(job, commit):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(download_child, "fetch", no_space)
    reason, details, _ = failed_download(tmp_path, hub.url)
    assert reason == "The disk is full: free some space, then try again."
    assert "No space left on device" in details
    assert_quiet(capfd)


def test_offline_mode_and_the_unexpected_are_sentences_too():
    from huggingface_hub.errors import OfflineModeIsEnabled

    offline_mode = explain(OfflineModeIsEnabled("offline"), "o/m")
    assert offline_mode.message == "Offline mode is on (HF_HUB_OFFLINE is set): unset it to reach the Hub."
    try:
        raise KeyError("surprise")
    except KeyError as err:
        unexpected = explain(err, "o/m")
    assert (
        unexpected.message == "Something unexpected went wrong (KeyError): the details are in the log file."
    )
    assert "Traceback" in unexpected.details and "surprise" in unexpected.details


def test_a_search_names_no_model_when_the_address_is_wrong(capfd, hub):
    hub.faults.status = 404
    with pytest.raises(HubError) as caught:
        hub_client.search_models("qwen", endpoint=hub.url)
    host = hub.url.removeprefix("http://")
    assert (
        str(caught.value)
        == f"The Hub at {host} has no such page (HTTP 404): check the Hub address (HF_ENDPOINT)."
    )
    assert_quiet(capfd)


def test_the_probe_goes_through_the_proxy_the_environment_names(monkeypatch):
    port = closed_port()
    monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(HubError) as caught:
        check_reachable("https://huggingface.co")
    assert caught.value.failure.kind == "refused"
    assert f"through the proxy 127.0.0.1:{port}" in caught.value.failure.details


@pytest.fixture
def mute_server():
    """A server that accepts every connection, reads the request and never answers it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    for sock in (*accepted, server):
        sock.close()


def test_a_hub_that_accepts_and_never_answers_is_bounded_too(capfd, mute_server, monkeypatch):
    """huggingface_hub's own client has no timeout: the search would wait forever on such a server."""
    import huggingface_hub.constants

    import app.download_child.hub_errors as hub_errors

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # conftest imported it offline
    monkeypatch.setattr(hub_errors, "READ_TIMEOUT_S", 0.3)
    start = time.monotonic()
    with pytest.raises(HubError):
        hub_client.search_models("qwen", endpoint=mute_server)
    assert time.monotonic() - start < 30  # huggingface_hub retries a timed-out read a few times
    assert_quiet(capfd)
