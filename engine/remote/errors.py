"""What can go wrong talking to a remote engine, as `RemoteError`s with a stable `kind`.

`classify(err, during_reply)` turns what the `openai` client raises (and the HTTP
library under it) into one `RemoteError` whose message is one sentence for the
user and whose `kind` a front end can act on: `retryable` kinds get a Retry
button, `retry_after_s` says how long a 429 asked to wait. An API key never
appears in a message (the client's errors do not carry request headers, and
nothing here adds them).
"""

from __future__ import annotations

import email.utils
import ssl
import time
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError

if TYPE_CHECKING:
    import openai

UNREACHABLE = "remote_unreachable"  # refused, no route, DNS: nothing answered
TIMEOUT = "remote_timeout"
TLS = "remote_tls"
UNAUTHORIZED = "remote_unauthorized"  # 401 / 403: a missing or wrong API key
RATE_LIMITED = "remote_rate_limited"  # 429
SERVER_ERROR = "remote_server_error"  # 5xx
CONTEXT_LENGTH = "context_length_exceeded"  # the same kind as engine.errors.ContextLengthError
MODEL_NOT_FOUND = "model_not_found"
BAD_REQUEST = "remote_bad_request"  # any other 4xx: the remote refused what was asked
STREAM_CUT = "remote_stream_cut"  # the connection ended in the middle of a reply
PROTOCOL = "remote_protocol"  # an answer that is not the OpenAI API
UNSUPPORTED = "remote_unsupported"  # a request only the local engine serves (auto-tune)

RETRYABLE = frozenset({UNREACHABLE, TIMEOUT, RATE_LIMITED, SERVER_ERROR, STREAM_CUT})
# how servers word a prompt longer than the model's window (vLLM, SGLang, llama.cpp, OpenAI, ours)
_CONTEXT_WORDS = ("context length", "context_length", "context window", "maximum context", "too long")


class RemoteError(EngineError):
    """A remote engine's failure; `kind` says which (see this module's constants)."""

    kind = "remote"

    def __init__(
        self, kind: str, message: str, status: int | None = None, retry_after_s: float | None = None
    ):
        super().__init__(message)
        self.kind = kind
        self.status = status  # the HTTP status, where the remote answered
        self.retry_after_s = retry_after_s  # a 429's Retry-After, in seconds

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": str(self), "retry_after_s": self.retry_after_s}


def classify(err: BaseException, url: str, during_reply: bool = False) -> RemoteError:
    """The `RemoteError` for what the client raised talking to `url`; `during_reply`: some of a
    reply had arrived, so a lost connection is a cut stream, not an unreachable server."""
    import openai  # here, not at the top: the kinds above are read where the client is not loaded

    if isinstance(err, RemoteError):
        return err
    if isinstance(err, openai.APITimeoutError):
        return RemoteError(TIMEOUT, f"{url} did not answer in time; try again, or raise the timeout.")
    if isinstance(err, openai.APIStatusError):
        return _from_status(err, url)
    if isinstance(err, openai.APIConnectionError):
        return _from_connection(err, url, during_reply)
    if isinstance(err, openai.APIResponseValidationError | ValueError):
        return RemoteError(PROTOCOL, f"{url} answered with something that is not the OpenAI API: {err}")
    return RemoteError(PROTOCOL, f"Talking to {url} failed: {type(err).__name__}: {err}")


def _from_connection(err: BaseException, url: str, during_reply: bool) -> RemoteError:
    causes = list(_causes(err))
    if any(isinstance(c, ssl.SSLError) for c in causes) or "CERTIFICATE_VERIFY_FAILED" in str(causes):
        return RemoteError(
            TLS,
            f"The TLS connection to {url} failed ({_deepest(causes)}): check the https address and the "
            "server's certificate (or use http:// for a server without TLS).",
        )
    if during_reply:
        return RemoteError(
            STREAM_CUT,
            f"The connection to {url} was cut in the middle of the reply; the part received is kept.",
        )
    if any(isinstance(c, ConnectionRefusedError) for c in causes) or "refused" in str(causes).lower():
        return RemoteError(
            UNREACHABLE, f"{url} refused the connection: is the server running and is the address right?"
        )
    return RemoteError(UNREACHABLE, f"Cannot reach {url} ({_deepest(causes)}).")


def _from_status(err: openai.APIStatusError, url: str) -> RemoteError:
    status, detail = err.status_code, _detail(err)
    if status in (401, 403):
        return RemoteError(
            UNAUTHORIZED,
            f"{url} refused the API key (HTTP {status}: {detail}); check the key stored for this endpoint.",
            status,
        )
    if status == 429:
        wait = retry_after(err.response.headers.get("retry-after"))
        after = f" Retry after {wait:g} s." if wait is not None else " Wait a little and retry."
        return RemoteError(RATE_LIMITED, f"{url} is rate-limiting requests ({detail}).{after}", status, wait)
    if status >= 500:
        return RemoteError(SERVER_ERROR, f"{url} failed (HTTP {status}: {detail}); retry later.", status)
    if any(word in detail.lower() for word in _CONTEXT_WORDS):
        return RemoteError(
            CONTEXT_LENGTH,
            f"The conversation is longer than the remote model's context window ({detail}). Start a new "
            "chat or drop the oldest turns.",
            status,
        )
    if status == 404:
        return RemoteError(MODEL_NOT_FOUND, f"{url} has no such model or route (HTTP 404: {detail}).", status)
    return RemoteError(BAD_REQUEST, f"{url} refused the request (HTTP {status}: {detail}).", status)


def _detail(err: openai.APIStatusError) -> str:
    """The server's own words: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, or the text."""
    body = err.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        body = (inner.get("message") or inner.get("detail") or inner) if isinstance(inner, dict) else inner
    text = body if isinstance(body, str) else str(body) if body is not None else err.message
    return " ".join(text.split())[:300]


def retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds: a number of seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _causes(err: BaseException):
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _deepest(causes: list[BaseException]) -> str:
    last = causes[-1]
    return f"{type(last).__name__}: {last}" if str(last) else type(last).__name__
