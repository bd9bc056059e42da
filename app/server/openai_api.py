"""OpenAI's chat-completions API over an `EngineSession`, without HTTP.

`ChatBackend` turns a request body (decoded JSON) into a response body, or into
the chunks of a streamed response; anything wrong becomes an `ApiError` that
carries the HTTP status and OpenAI's error body. `app.server.openai_server` only moves
these dicts over HTTP, so the API is testable without a socket.

Understood: `messages` (system, developer, user, assistant; content as a string
or as text parts), `model`, `stream`, `stream_options.include_usage`,
`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`
and `n` (1 only). What a request leaves out comes from the server's command line
(`--temperature`, `--max-new-tokens`, `--spec` …). Features the engine does not
have (tools, logprobs, penalties …) are refused with a 400, never silently ignored.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from engine.errors import EngineError
from engine.generation_config import GenerationConfig
from engine.worker.client import EngineSession, WorkerDied
from engine.worker.protocol import ChatMessage, Finished, Token

log = logging.getLogger(__name__)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "response_format",
    "presence_penalty",
    "frequency_penalty",
    "audio",
    "modalities",
    "prediction",
)
# Values of UNSUPPORTED fields that ask for nothing the engine lacks (clients send some by default).
HARMLESS = (None, False, 0, [], {}, "none", "auto", {"type": "text"})


class ApiError(Exception):
    """An error response: HTTP status and OpenAI's `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}
        return {"error": error}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def model_not_found(asked: object, served: str) -> ApiError:
    message = f"The model {asked!r} does not exist; this server has {served!r}."
    return ApiError(404, message, param="model", code="model_not_found")


def api_error(err: EngineError) -> ApiError:
    """The HTTP face of an engine error."""
    if isinstance(err, WorkerDied):
        message = f"{err} Restart the server to load the model again."
        return ApiError(503, message, "server_error", code="engine_unavailable")
    if err.kind in ("invalid_request", "invalid_config"):
        return ApiError(400, str(err), code=err.kind)
    return ApiError(500, str(err), "server_error", code=err.kind)


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    try:
        yield
    except EngineError as err:
        raise api_error(err) from err


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    config: GenerationConfig
    stream: bool
    include_usage: bool


def parse_chat_request(body: object, model_id: str, defaults: GenerationConfig) -> ChatRequest:
    """Check a chat-completions body; raises `ApiError` (400, or 404 for another model)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    model = body.get("model", model_id)
    if model != model_id:
        raise model_not_found(model, model_id)
    for name in UNSUPPORTED:
        if body.get(name) not in HARMLESS:
            raise invalid(f"{name} is not supported by this server.", name)
    if body.get("n") not in (None, 1):
        raise invalid("Only n=1 is supported: one choice per request.", "n")
    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict) or {}
    include_usage = stream and options.get("include_usage") is True
    with engine_errors():
        config = _generation_config(body, defaults)
        config.validate()
    return ChatRequest(model, _messages(body.get("messages")), config, stream, include_usage)


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty array.", "messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object.", where)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(
                f"{where}.role {role!r} is not supported: use system, developer, user or assistant.",
                f"{where}.role",
            )
        messages.append(ChatMessage(ROLES[role], _content(message.get("content"), f"{where}.content")))
    return tuple(messages)


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in value
    ):
        return "".join(part["text"] for part in value)
    raise invalid(f"{where} must be a string or a list of text parts (the model reads text only).", where)


def _generation_config(body: dict, defaults: GenerationConfig) -> GenerationConfig:
    config, sampling = defaults, defaults.sampling
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        max_tokens = _typed(body, name, int)
        if max_tokens is not None:
            if max_tokens < 1:
                raise invalid(f"{name} must be at least 1.", name)
            config = replace(config, max_new_tokens=max_tokens)
            break
    temperature = _number(body, "temperature", 0, 2)
    if temperature is not None:  # the request's choice wins over --greedy; 0 means greedy
        sampling = replace(sampling, temperature=temperature, greedy=False)
    top_p = _number(body, "top_p", 0, 1)
    if top_p is not None:
        if top_p == 0:
            raise invalid("top_p must be greater than 0.", "top_p")
        sampling = replace(sampling, top_p=top_p)
    if "seed" in body:
        sampling = replace(sampling, seed=_typed(body, "seed", int))
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid("stop must be a non-empty string or an array of them.", "stop")
        config = replace(config, stop_strings=tuple(stops))
    return replace(config, sampling=sampling)


def _typed(body: dict, name: str, kind: type) -> Any:
    """body[name] when it is a `kind` (None when absent or null); a bool is not an int here."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise invalid(f"{name} must be {'an' if kind is int else 'a'} {_KIND_NAMES[kind]}.", name)
    return value


_KIND_NAMES = {int: "integer", bool: "boolean", dict: "object"}


def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"{name} must be a number.", name)
    if not low <= value <= high:
        raise invalid(f"{name} must be between {low} and {high}, got {value}.", name)
    return float(value)


class ChatBackend:
    """The API over one loaded model. Requests wait their turn: the session runs one at a time."""

    def __init__(self, session: EngineSession, model_id: str, defaults: GenerationConfig):
        self.session, self.model_id, self.defaults = session, model_id, defaults
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self, model_id: str | None = None) -> dict[str, Any]:
        if model_id is not None and model_id != self.model_id:
            raise model_not_found(model_id, self.model_id)
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "moe-chat"}

    def complete(self, body: object) -> dict[str, Any]:
        """A whole (not streamed) chat completion."""
        request = parse_chat_request(body, self.model_id, self.defaults)
        with engine_errors():
            *_, finished = self.session.generate(list(request.messages), request.config)  # Finished is last
        return {
            **_envelope("chat.completion", request.model),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": finished.text},
                    "finish_reason": FINISH_REASONS.get(finished.reason, "stop"),
                    "logprobs": None,
                }
            ],
            "usage": _usage(finished),
        }

    def stream(self, body: object) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed completion; closing the iterator cancels the generation.

        The first chunk comes once the engine made its first token, so every error until then
        (a bad request, the queue, the engine) still has its own HTTP status."""
        request = parse_chat_request(body, self.model_id, self.defaults)
        events = self.session.generate(list(request.messages), request.config)
        try:
            with engine_errors():
                first = next(events)
                envelope = _envelope("chat.completion.chunk", request.model)
                if request.include_usage:
                    envelope["usage"] = None
                yield _chunk(envelope, {"role": "assistant", "content": ""})
                for event in itertools.chain([first], events):
                    yield from _event_chunks(envelope, event, request.include_usage)
        finally:
            events.close()  # cancels the generation unless it finished


def _event_chunks(envelope: dict, event: Token | Finished, include_usage: bool) -> Iterator[dict[str, Any]]:
    if isinstance(event, Token):
        if event.text:
            yield _chunk(envelope, {"content": event.text})
        return
    if event.tail:
        yield _chunk(envelope, {"content": event.tail})
    yield _chunk(envelope, {}, FINISH_REASONS.get(event.reason, "stop"))
    if include_usage:
        yield {**envelope, "choices": [], "usage": _usage(event)}


def _envelope(kind: str, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }


def _chunk(envelope: dict, delta: dict, finish_reason: str | None = None) -> dict[str, Any]:
    return {
        **envelope,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def _usage(finished: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }
