"""OpenAI's chat-completions API over an engine (`ChatEngine`: the server's own `EngineSession`, or
the window's), without HTTP; `/v1/completions` goes through the same backend
(`app.server.completions_api`).

`ChatBackend` turns a request body (decoded JSON) into a response body, or into
the chunks of a streamed response; anything wrong becomes an `ApiError` that
carries the HTTP status and OpenAI's error body. `app.server.openai_server` only moves
these dicts over HTTP, so the API is testable without a socket.

Understood: `messages` (system, developer, user, assistant with `tool_calls`, tool with
`tool_call_id`; content as a string or as text parts), `model`, `stream`,
`stream_options.include_usage`, `max_tokens` / `max_completion_tokens`, `temperature`,
`top_p`, `top_k`, `min_p`, `repetition_penalty`, `seed`, `stop`, `n` (the choices generated one
after another, choice i with seed + i), `tools` with `tool_choice` auto, none, required or a
named function (the calls the model writes in its `<tool_call>` format, or gpt-oss's harmony
messages to `functions.NAME`, come back as `tool_calls`; a forced call is held to the function's
parameters by engine.constraints), `response_format`
(json_object / json_schema, enforced by engine.constraints), `presence_penalty`,
`frequency_penalty` and `logit_bias` (OpenAI's definitions), `logprobs` / `top_logprobs`
(the distribution each token was drawn from, streamed too), `chat_template_kwargs`
and `reasoning_effort`, checked by `app.server.schemas`; a thinking model's reasoning is
`reasoning_content`. What a request leaves out comes from the server's command line
(`--temperature`, `--max-new-tokens`, `--spec` …). Features the engine does not have
(audio, the old `functions` …) are refused with a 400, never silently
ignored. Each response (a streamed one in its last chunk, the one
with the finish reason) carries `stats`: the drafter and prefetch policy that ran
(`auto` by default: the model's drafter with SP-MoE) and the DESIGN.md metrics.

The engine is supervised: when its worker dies (a crash, kill -9, a stall), the request
that saw it gets a 503 and a new worker is started in the background with the same model
(from the converted-store cache, so in seconds); `health()` says which state it is in.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

from app.server import completions_api
from app.server.replies import (
    chat_logprobs,
    chat_message,
    chunk,
    engine_stats,
    envelope,
    event_chunks,
    finish_reason,
    usage,
)
from app.server.request_config import (
    ChatRequest,
    api_error,
    checked_request,
    choice_configs,
    model_not_found,
    request_config,
    served_model,
)
from app.server.schemas import ApiError, ChatCompletionRequest, invalid
from app.server.tool_calls import ToolCallStream, template_calls
from engine.errors import EngineError
from engine.generation_config import CompletionPrompt, GenerationConfig
from engine.worker.client import WorkerDied
from engine.worker.protocol import ChatMessage, Finished, Token

log = logging.getLogger(__name__)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
WATCH_INTERVAL_S = 1.0


def parse_chat_request(body: object, model_id: str, defaults: GenerationConfig) -> ChatRequest:
    """Check a chat-completions body; raises `ApiError` (400, or 404 for another model)."""
    request = ChatCompletionRequest.parse(body)
    model = served_model(request, model_id)
    messages = tuple(_chat_message(m) for m in request.messages)
    return checked_request(request, model, messages, _generation_config(request, defaults))


def _chat_message(message) -> ChatMessage:
    calls = template_calls([c.model_dump() for c in message.tool_calls or ()])
    return ChatMessage(ROLES[message.role], message.text, calls, message.tool_call_id)


def _generation_config(request: ChatCompletionRequest, defaults: GenerationConfig) -> GenerationConfig:
    max_tokens = request.max_completion_tokens or request.max_tokens  # the newer name wins
    config = request_config(request, defaults, max_tokens)
    config = replace(config, logprobs=request.logprob_alternatives())
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:  # gpt-oss's templates read it; others ignore it
        kwargs["reasoning_effort"] = request.reasoning_effort
    if kwargs:
        config = replace(config, template_kwargs=kwargs)
    if request.response_format is not None and request.response_format.type != "text":
        # held to the JSON by the grammar, token by token: plain decoding (engine.constraints)
        response_format = request.response_format.model_dump(by_alias=True, exclude_none=True)
        config = replace(config, response_format=response_format, spec=replace(config.spec, mode="none"))
    return _tool_config(request, config)


def _tool_config(request: ChatCompletionRequest, config: GenerationConfig) -> GenerationConfig:
    """The tools and the tool choice: a forced call ("required", a named function) is held to the
    function's parameters by a grammar, token by token, so it decodes plainly."""
    choice = request.tool_choice
    if choice is None or choice == "auto":
        return replace(config, tools=tuple(t.model_dump(exclude_none=True) for t in request.tools or ()))
    if choice == "none":
        return config  # the template is not shown the tools; the text is not read for calls
    if not request.tools:
        raise invalid("tool_choice forces a call, but the request has no tools.", "tool_choice")
    names = [t.function.name for t in request.tools]
    if not isinstance(choice, str) and choice.function.name not in names:
        raise invalid(
            f"tool_choice names the function {choice.function.name!r}, which is not among the tools "
            f"({', '.join(names)}).",
            "tool_choice",
        )
    tools = tuple(t.model_dump(exclude_none=True) for t in request.tools)
    tool_choice = choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)
    return replace(config, tools=tools, tool_choice=tool_choice, spec=replace(config.spec, mode="none"))


class EngineState(enum.Enum):
    READY = "ok"
    RESTARTING = "restarting"
    FAILED = "unavailable"


class ChatEngine(Protocol):
    """What `ChatBackend` asks of the engine: an `EngineSession` on the server's own worker, or
    the window's engine when the app serves the model it has loaded (`app.gui.server`)."""

    restarts: int  # engines brought back after one died
    model: dict | None  # the loaded model's `Loaded` info (architecture, sizes, precision …), if known

    @property
    def alive(self) -> bool:
        """Whether the engine can answer now (its worker runs, with the model loaded)."""

    def restart(self) -> None:
        """Bring the engine back with its model; blocks until it can answer, or raises `EngineError`."""

    def generate(
        self,
        messages: list[ChatMessage],
        config: GenerationConfig,
        completion: CompletionPrompt | None = None,
    ) -> Iterator[Token | Finished]:
        """`Token`s then one `Finished` (see `EngineSession.generate`); closing it early cancels.
        `completion`: a prompt continued as written, in place of the messages."""


class ChatBackend:
    """The API over one loaded model. Requests wait their turn: the engine runs one at a time.
    `model_id` is the name requests use; the window changes it when another model is loaded."""

    def __init__(self, engine: ChatEngine, model_id: str, defaults: GenerationConfig):
        self.engine, self.model_id, self.defaults = engine, model_id, defaults
        self.created = int(time.time())
        self.state = EngineState.READY
        self.state_detail = ""
        self._restart_lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._watch_worker, name="engine-watch", daemon=True).start()

    def close(self) -> None:
        self._closed.set()

    def _watch_worker(self) -> None:
        """A worker that dies between requests is noticed within a second and started again."""
        while not self._closed.wait(WATCH_INTERVAL_S):
            if self.state is EngineState.READY and not self.engine.alive:
                log.warning("The engine process stopped; starting it again.")
                self._restart_in_background()

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self, model_id: str | None = None) -> dict[str, Any]:
        if model_id is not None and model_id != self.model_id:
            raise model_not_found(model_id, self.model_id)
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "moe-chat"}

    def model_info(self) -> dict[str, Any] | None:
        """The loaded model's `Loaded` info (architecture, sizes, precision …), when the engine has it."""
        return self.engine.model

    def health(self) -> tuple[int, dict[str, Any]]:
        """HTTP status and body of `/health`: 200 while the engine can answer, else 503."""
        body = {"status": self.state.value, "model": self.model_id, "restarts": self.engine.restarts}
        if self.state_detail:
            body["detail"] = self.state_detail
        return (200 if self.state is EngineState.READY else 503), body

    def complete(self, body: object, cancelled: threading.Event | None = None) -> dict[str, Any]:
        """A whole (not streamed) chat completion; setting `cancelled` (the client left) cancels it."""
        request = parse_chat_request(body, self.model_id, self.defaults)
        choices, replies = [], []
        for index, config in enumerate(choice_configs(request.config, request.n)):
            finished, tokens = self.reply(request, config, cancelled)
            message = chat_message(finished, bool(config.tools))
            logprobs = [entry for token in tokens for entry in token.logprobs]
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "finish_reason": finish_reason(finished, "tool_calls" in message),
                    "logprobs": chat_logprobs(logprobs) if config.logprobs is not None else None,
                }
            )
            replies.append(finished)
        return {
            **envelope("chat.completion", request.model),
            "choices": choices,
            "usage": usage(replies, request.n),
            "stats": engine_stats(replies[-1]),
        }

    def completion(self, body: object, cancelled: threading.Event | None = None) -> dict[str, Any]:
        """A whole `/v1/completions` reply (`app.server.completions_api`)."""
        return completions_api.complete(self, body, cancelled)

    def completion_stream(self, body: object) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed `/v1/completions` reply; closing them cancels."""
        return completions_api.stream(self, body)

    def reply(
        self, request: ChatRequest, config: GenerationConfig, cancelled: threading.Event | None
    ) -> tuple[Finished, list[Token]]:
        """One whole reply to `request` with `config`: its `Finished` and its `Token`s."""
        finished, tokens = None, []
        with self._engine_errors(), contextlib.closing(self._generate(request, config)) as events:
            for event in events:
                if cancelled is not None and cancelled.is_set():
                    raise ApiError(499, "The client closed the request.", code="client_closed_request")
                if isinstance(event, Finished):
                    finished = event
                else:
                    tokens.append(event)
        _log_reply(request, finished)
        return finished, tokens

    def stream(self, body: object) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed completion (its `n` choices one after another); closing the
        iterator cancels the generation.

        The first chunk comes once the engine made its first token, so every error until then
        (a bad request, the queue, the engine) still has its own HTTP status."""
        request = parse_chat_request(body, self.model_id, self.defaults)
        head = envelope("chat.completion.chunk", request.model)
        if request.include_usage:
            head["usage"] = None
        replies = []
        for index, events in self.replies(request):
            yield chunk(head, {"role": "assistant", "content": ""}, index=index)
            calls = ToolCallStream() if request.config.tools else None
            for event in events:
                if isinstance(event, Finished):
                    replies.append(event)
                yield from event_chunks(head, event, calls, index)
        if request.include_usage:
            yield {**head, "choices": [], "usage": usage(replies, request.n)}

    def replies(self, request: ChatRequest) -> Iterator[tuple[int, Iterator[Token | Finished]]]:
        """Each choice's index and events, one after another, the first once it has a first event
        (errors until then keep their status); closing this cancels the reply under way."""
        for index, config in enumerate(choice_configs(request.config, request.n)):
            events = self._generate(request, config)
            try:
                with self._engine_errors():
                    first = next(events)
                    yield index, self._checked(request, itertools.chain([first], events))
            finally:
                events.close()  # cancels the generation unless it finished

    def _checked(self, request: ChatRequest, events: Iterator[Token | Finished]) -> Iterator:
        """`events`, engine errors as `ApiError`s, the reply logged when it ends."""
        with self._engine_errors():
            for event in events:
                if isinstance(event, Finished):
                    _log_reply(request, event)
                yield event

    def _generate(self, request: ChatRequest, config: GenerationConfig) -> Iterator[Token | Finished]:
        if self.state is EngineState.FAILED:
            self._restart_in_background()  # try again: the cause (a full disk …) may be gone
        return self.engine.generate(list(request.messages), config, request.completion)

    @contextlib.contextmanager
    def _engine_errors(self) -> Iterator[None]:
        try:
            yield
        except WorkerDied as err:
            self._restart_in_background()
            raise api_error(err) from err
        except EngineError as err:
            raise api_error(err) from err

    def _restart_in_background(self) -> None:
        """Start a new worker with the same model now, so the next request finds it ready."""
        if not self._restart_lock.acquire(blocking=False):
            return  # one restart at a time
        self.state, self.state_detail = EngineState.RESTARTING, ""

        def restart() -> None:
            try:
                self.engine.restart()
                self.state = EngineState.READY
            except EngineError as err:
                log.error("The engine could not be restarted: %s", err)
                self.state, self.state_detail = EngineState.FAILED, str(err)
            finally:
                self._restart_lock.release()

        threading.Thread(target=restart, name="engine-restart", daemon=True).start()


def _log_reply(request: ChatRequest, finished: Finished) -> None:
    """One line a reply, for the server's log (and the window's request log)."""
    speed = finished.stats.get("tokens_per_s")
    log.info(
        "%s: %d prompt tokens, %d generated%s, finish %s",
        request.model,
        finished.prompt_tokens,
        finished.completion_tokens,
        f" at {speed:.1f} tok/s" if speed else "",
        finished.reason,
    )
