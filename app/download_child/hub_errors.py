"""Failures talking to the Hugging Face Hub, in one plain sentence the user can act on.

`explain(err, repo_id, endpoint)` turns any exception of a Hub call (huggingface_hub's, httpx's,
the socket's, the disk's) into a `HubFailure`: its kind, one sentence with the action to take
(shown in the picker in full), and the technical details (the exception chain with its
traceback, shown behind "Details…" and written to the log file, never to the console).

`check_reachable(endpoint)` answers within `PROBE_TIMEOUT_S`: no name resolution, a refused
connection or no answer raise `HubError` at once. huggingface_hub retries a failed connection
five times with back-off (about 23 s) before it gives up, so every search and download asks
this first. It goes through the proxy the environment names, as httpx would.

`quiet_hub_logging()` removes the stderr handler huggingface_hub adds to its own logger: its
records ("Retrying in 1s…") then reach only the app's handlers (the log file).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import socket
import threading
import traceback
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 2.0
DEFAULT_ENDPOINT = "https://huggingface.co"
OFFLINE_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN}
BROKEN_CONNECTION = ("RemoteProtocolError", "ReadError", "WriteError", "ProtocolError")  # httpx's names
TIMEOUTS = ("ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "TimeoutException")


@dataclass(frozen=True)
class HubFailure:
    kind: str  # offline, refused, timeout, unauthorized, forbidden, not_found, rate_limited, gated, …
    message: str  # one sentence for the user, with what to do
    details: str = ""  # for "Details…" and the log file


class HubError(Exception):
    """An expected failure of a Hub call; `str()` is the sentence for the user."""

    def __init__(self, failure: HubFailure):
        super().__init__(failure.message)
        self.failure = failure


class DownloadError(Exception):
    """A failure whose message is meant for the user as it is."""


def endpoint_label(endpoint: str | None) -> str:
    """How a sentence names the Hub: 'huggingface.co', or 'the Hub at host:port' for another one."""
    url = urlsplit(endpoint or hub_endpoint())
    if (url.hostname or "") == "huggingface.co":
        return "huggingface.co"
    return f"the Hub at {url.netloc}"


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


# -- the sentences -------------------------------------------------------------------------------


def _sentence(kind: str, label: str, repo: str, extra: str = "") -> str:
    text = {
        "offline": f"This computer seems to be offline ({label} cannot be reached): "
        "check the internet connection, then try again.",
        "refused": f"{label} refused the connection: check the Hub address (HF_ENDPOINT) or the proxy "
        "settings, then try again.",
        "timeout": f"{label} did not answer in time: check the internet connection, then try again.",
        "interrupted": f"The connection to {label} broke off: try again.",
        "unauthorized": f"The Hub did not accept the Hugging Face token (HTTP {extra}): set a valid one with "
        "“Hugging Face token…”, then try again.",
        "forbidden": f"The Hub refused access to {repo} (HTTP 403): set a token that may read it with "
        "“Hugging Face token…”, then try again.",
        "not_found": f"{repo} is not on the Hub: check its name (a private model needs a Hugging Face "
        "token).",
        "wrong_address": f"{label} has no such page (HTTP 404): check the Hub address (HF_ENDPOINT).",
        "revision": f"{repo} has no revision {extra!r} on the Hub: choose another revision.",
        "rate_limited": "The Hub is limiting requests from this computer (HTTP 429): "
        "wait a few minutes, then try again.",
        "server": f"The Hub had a problem (HTTP {extra}): try again in a few minutes.",
        "gated": f"{repo} is gated: accept its terms at https://huggingface.co/{repo}, "
        "then set a Hugging Face token.",
        "offline_mode": "Offline mode is on (HF_HUB_OFFLINE is set): unset it to reach the Hub.",
        "disk_full": "The disk is full: free some space, then try again.",
        "unexpected": f"Something unexpected went wrong ({extra}): the details are in the log file.",
    }[kind]
    return "T" + text[1:] if text.startswith("the ") else text  # "the Hub at …" opens a sentence


def explain(
    err: BaseException, repo_id: str | None = None, endpoint: str | None = None, revision: str = "main"
) -> HubFailure:
    """The failure `err` in words (see the module docstring)."""
    details = "".join(traceback.format_exception(err)).rstrip()
    chain = _chain(err)
    for cause in chain:
        if isinstance(cause, HubError):
            return cause.failure
        if isinstance(cause, DownloadError):
            return HubFailure("download", str(cause), details)
    kind, extra = next(filter(None, (_kind_of(cause) for cause in chain)), ("unexpected", type(err).__name__))
    if repo_id is None and kind in ("not_found", "forbidden"):  # a search or a token check: no model to name
        kind = "wrong_address" if kind == "not_found" else "unauthorized"
    message = _sentence(kind, endpoint_label(endpoint), repo_id or "", extra or revision)
    return HubFailure(kind, message, details)


def _chain(err: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    while err is not None and len(chain) < 10 and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _kind_of(cause: BaseException) -> tuple[str, str] | None:
    """(kind, extra) for one exception of the chain, None when it says nothing useful."""
    name = type(cause).__name__
    hub_kind = _hub_kind(cause, name)
    if hub_kind is not None:
        return hub_kind
    if name in TIMEOUTS or isinstance(cause, TimeoutError):
        return "timeout", ""
    if name in BROKEN_CONNECTION or "Consistency check failed" in str(cause):
        return "interrupted", ""
    if isinstance(cause, (socket.gaierror, ConnectionRefusedError)) or name == "ConnectError":
        return _connect_kind(cause)
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        return "disk_full", ""
    if isinstance(cause, OSError) and cause.errno in OFFLINE_ERRNOS:
        return "offline", ""
    if isinstance(cause, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return "interrupted", ""
    return None


def _connect_kind(cause: BaseException) -> tuple[str, str]:
    text = str(cause)
    if isinstance(cause, ConnectionRefusedError) or "Connection refused" in text or "[Errno 111]" in text:
        return "refused", ""
    return "offline", ""  # no such name, no route, network down


def _hub_kind(cause: BaseException, name: str) -> tuple[str, str] | None:
    """huggingface_hub's own errors (checked by name: this module imports no huggingface_hub)."""
    if name == "OfflineModeIsEnabled":
        return "offline_mode", ""
    if name == "GatedRepoError":
        return "gated", ""
    if name == "RevisionNotFoundError":
        return "revision", ""
    status = getattr(getattr(cause, "response", None), "status_code", None)
    if name == "RepositoryNotFoundError":
        return ("not_found", "404") if status != 403 else ("forbidden", "403")
    if not isinstance(status, int) or status < 400:
        return None
    by_status = {401: "unauthorized", 403: "forbidden", 404: "not_found", 429: "rate_limited"}
    if status in by_status:
        return by_status[status], str(status)
    return ("server", str(status)) if status >= 500 else None


# -- a quick look before a slow call -------------------------------------------------------------

CONNECT_TIMEOUT_S = 10.0  # opening a connection to the Hub (the probe below answers offline in 2 s)
READ_TIMEOUT_S = 60.0  # a Hub that accepted the connection but sends nothing for this long is stuck


def bound_hub_requests() -> None:
    """Bound every HTTP request huggingface_hub makes. Its API calls pass no timeout (a server
    that accepts a connection and never answers would hang a search or a download forever), and it
    replaces its shared client after a failed attempt: so each client its factory makes gets a
    transport that fills in our bounds wherever a request says None."""
    from huggingface_hub import set_client_factory

    try:
        from huggingface_hub.utils._http import default_client_factory
    except ImportError:  # a release without it: its own defaults stand
        return
    set_client_factory(lambda: _bounded(default_client_factory()))


class _BoundedTransport:
    """An httpx transport that gives a request with no timeout ours, then hands it on."""

    def __init__(self, transport):
        self.transport = transport

    def handle_request(self, request):
        bounds = {"connect": CONNECT_TIMEOUT_S, "read": READ_TIMEOUT_S, "write": READ_TIMEOUT_S}
        asked = request.extensions.get("timeout") or {}
        bounds["pool"] = CONNECT_TIMEOUT_S
        request.extensions["timeout"] = {k: asked.get(k) or bound for k, bound in bounds.items()}
        return self.transport.handle_request(request)

    def close(self) -> None:
        self.transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bounded(client):
    """`client` with every transport (its own and its proxies') bounded; as it was if the client
    does not look like the httpx one huggingface_hub has used (nothing is broken, only unbounded)."""
    transport, mounts = getattr(client, "_transport", None), getattr(client, "_mounts", None)
    if transport is None or not isinstance(mounts, dict):
        return client
    client._transport = _BoundedTransport(transport)
    for pattern, mounted in mounts.items():
        if mounted is not None:
            mounts[pattern] = _BoundedTransport(mounted)
    return client


def check_reachable(endpoint: str | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise `HubError` unless a TCP connection to the Hub (or its proxy) opens within `timeout_s`;
    the Hub calls that follow are bounded too (`bound_hub_requests`)."""
    bound_hub_requests()
    url = urlsplit(endpoint or hub_endpoint())
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    proxy = _proxy_for(url.scheme, host)
    try:
        _connect(*(proxy or (host, port)), timeout_s)
    except OSError as err:
        failure = explain(err, endpoint=endpoint)
        if proxy is not None:
            via = f" (through the proxy {proxy[0]}:{proxy[1]})"
            failure = HubFailure(failure.kind, failure.message, f"{failure.details}{via}")
        raise HubError(failure) from err


def _proxy_for(scheme: str, host: str) -> tuple[str, int] | None:
    proxies = urllib.request.getproxies()
    address = proxies.get(scheme) or proxies.get("all")
    if not address or urllib.request.proxy_bypass(host):
        return None
    proxy = urlsplit(address if "://" in address else f"http://{address}")
    return (proxy.hostname, proxy.port or 80) if proxy.hostname else None


def _connect(host: str, port: int, timeout_s: float) -> None:
    last: OSError = OSError(errno.EHOSTUNREACH, f"no address for {host}")
    for family, kind, proto, _, address in _resolve(host, port, timeout_s):
        with socket.socket(family, kind, proto) as probe:
            probe.settimeout(timeout_s)
            try:
                probe.connect(address)
                return
            except OSError as err:
                last = err
    raise last


def _resolve(host: str, port: int, timeout_s: float) -> list[tuple]:
    """getaddrinfo within `timeout_s` (it has no timeout of its own: a thread waits for it)."""
    answers: queue.Queue = queue.Queue(maxsize=1)

    def lookup() -> None:
        try:
            answers.put(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as err:
            answers.put(err)

    threading.Thread(target=lookup, name="hub-dns", daemon=True).start()
    try:
        answer = answers.get(timeout=timeout_s)
    except queue.Empty:
        raise socket.gaierror(socket.EAI_AGAIN, f"looking up {host} took over {timeout_s:g} s") from None
    if isinstance(answer, OSError):
        raise answer
    return answer


def quiet_hub_logging() -> None:
    """huggingface_hub's records go to the app's handlers only (see the module docstring)."""
    import huggingface_hub.utils.logging  # noqa: F401  (adds its handler when first imported)

    hub_logger = logging.getLogger("huggingface_hub")
    for handler in list(hub_logger.handlers):
        if type(handler) is logging.StreamHandler:
            hub_logger.removeHandler(handler)
