"""OpenAI's legacy `POST /v1/completions` over the same engine as chat: a prompt continued as
written, with no chat template — what code-completion plug-ins and evaluation harnesses send.

Understood: `prompt` (a string, a list of them, token ids or lists of token ids: each prompt its
own choices), `suffix` (fill-in-the-middle in the model's own format, where its tokenizer has the
tokens; else a 400), `echo` (the prompt before the reply; with `logprobs`, the prompt tokens'
log-probabilities too, the first `null`), `logprobs` (0 to 20 alternatives a token, with the token
itself, as vLLM gives them), `max_tokens` (OpenAI's default: 16), `n` (one choice after another),
`best_of` (only equal to `n`), `stream` with `stream_options.include_usage`, and the sampling
parameters chat takes (`app.server.request_config`). Choices are indexed prompt by prompt:
prompt `p`'s choice `i` is `p × n + i`.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request

from app.server.http_io import openai_reply
from app.server.replies import engine_stats, envelope, finish_reason, finite, usage
from app.server.request_config import (
    ChatRequest,
    checked_request,
    choice_configs,
    request_config,
    served_model,
)
from app.server.schemas import CompletionRequest, invalid
from engine.generation_config import CompletionPrompt, GenerationConfig
from engine.worker.protocol import Finished, Token, TokenLogprob

OPENAI_MAX_TOKENS = 16  # what `max_tokens` is when a completions request leaves it out (OpenAI's)


def add_routes(app: FastAPI, api) -> None:
    """`POST /v1/completions` on `app`, answered by `api.completion` / `api.completion_stream`."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai_reply(request, api, "completion", "completion_stream")


def parse_completion_request(body: object, model_id: str, defaults: GenerationConfig) -> list[ChatRequest]:
    """One `ChatRequest` a prompt of the body, each with its
    `CompletionPrompt`; raises `ApiError` (400, or 404 for another model)."""
    request = CompletionRequest.parse(body)
    model = served_model(request, model_id)
    n = request.n or 1
    if request.best_of is not None and request.best_of != n:
        message = "best_of is not supported: leave it out (or equal to n); each choice is returned."
        raise invalid(message, "best_of")
    config = request_config(request, defaults, request.max_tokens or OPENAI_MAX_TOKENS)
    config = replace(config, logprobs=request.logprobs)
    echo = bool(request.echo)
    return [
        checked_request(request, model, (), config, replace(prompt, suffix=request.suffix, echo=echo))
        for prompt in _prompts(request.prompt)
    ]


def _prompts(prompt: str | list) -> list[CompletionPrompt]:
    """The request's prompts: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [CompletionPrompt(prompt)]
    if not prompt:
        raise invalid("prompt is an empty list: give a string or token ids.", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [CompletionPrompt(p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [CompletionPrompt(token_ids=tuple(prompt))]
    if any(not p for p in prompt):
        raise invalid("prompt holds an empty list of token ids.", "prompt")
    return [CompletionPrompt(token_ids=tuple(p)) for p in prompt]


def complete(backend, body: object, cancelled: threading.Event | None = None) -> dict[str, Any]:
    """A whole `text_completion` for the body: every prompt's `n` choices, one after another."""
    requests = parse_completion_request(body, backend.model_id, backend.defaults)
    choices, replies = [], []
    for p, request in enumerate(requests):
        for i, config in enumerate(choice_configs(request.config, request.n)):
            finished, tokens = backend.reply(request, config, cancelled)
            choice = _Choice(request.completion, config.logprobs)
            for event in (*tokens, finished):
                choice.add(event)
            index, reason = p * request.n + i, finish_reason(finished)
            choices.append(_choice({}, index, choice.text, choice.logprobs(), reason)["choices"][0])
            replies.append(finished)
    n = requests[0].n
    return {
        **_envelope(requests[0]),
        "choices": choices,
        "usage": usage(replies, n),
        "stats": engine_stats(replies[-1]),
    }


def stream(backend, body: object):
    """The chunks of a streamed `text_completion`: each choice's text as it comes, its finish
    reason with MoE Chat's stats, and the usage last when asked for; closing them cancels."""
    requests = parse_completion_request(body, backend.model_id, backend.defaults)
    head, replies = _envelope(requests[0]), []
    for p, request in enumerate(requests):
        for i, events in backend.replies(request):
            index, choice = p * request.n + i, _Choice(request.completion, request.config.logprobs)
            for event in events:
                choice.add(event)
                text, logprobs = choice.delta()
                if isinstance(event, Finished):
                    replies.append(event)
                    last = _choice(head, index, text, logprobs, finish_reason(event))
                    yield {**last, "stats": engine_stats(event)}
                elif text or (logprobs and logprobs["tokens"]):
                    yield _choice(head, index, text, logprobs, None)
    if requests[0].include_usage:
        yield {**head, "choices": [], "usage": usage(replies, requests[0].n)}


def _envelope(request) -> dict[str, Any]:
    head = envelope("text_completion", request.model)
    head["id"] = "cmpl-" + head["id"].removeprefix("chatcmpl-")
    return head


def _choice(head: dict, index: int, text: str, logprobs: dict | None, reason: str | None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return {**head, "choices": [choice]}


class _Choice:
    """A choice's text (the echoed prompt first, where asked) and its legacy `logprobs` — the
    tokens, their log-probabilities, the top alternatives as {token: logprob} with the token itself,
    and each token's offset in the text — whole, or what came since the last `delta`."""

    def __init__(self, prompt: CompletionPrompt, top: int | None):
        self.prompt, self.top = prompt, top
        self.text = ""
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []
        self._sent = (0, 0)  # (characters, tokens) a `delta` has given

    def add(self, event: Token | Finished) -> None:
        if isinstance(event, Finished):
            self.text += event.reasoning_tail + event.tail
            return
        if event.echo is not None:
            scored = event.echo.logprobs  # the first token's None: nothing came before it
            self._add_logprobs(list(zip(event.echo.tokens, scored, strict=True)) if scored else [])
            self.text += self.prompt.text if self.prompt.text is not None else event.echo.text
        self._add_logprobs([(entry.token, entry) for entry in event.logprobs])
        self.text += event.reasoning + event.text

    def _add_logprobs(self, entries: list[tuple[str, TokenLogprob | None]]) -> None:
        offset = self.text_offset[-1] + len(self.tokens[-1]) if self.tokens else len(self.text)
        for token, entry in entries:
            self.tokens.append(token)
            self.text_offset.append(offset)
            offset += len(token)
            if entry is None:  # a prompt's first token: nothing came before it
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(finite(entry.logprob))
            top = {alternative: finite(lp) for alternative, lp in entry.top}
            self.top_logprobs.append({token: finite(entry.logprob), **top})

    def logprobs(self, start: int = 0) -> dict[str, Any] | None:
        if self.top is None:
            return None
        return {
            "tokens": self.tokens[start:],
            "token_logprobs": self.token_logprobs[start:],
            "top_logprobs": self.top_logprobs[start:],
            "text_offset": self.text_offset[start:],
        }

    def delta(self) -> tuple[str, dict[str, Any] | None]:
        """The text and logprobs added since the last call."""
        characters, tokens = self._sent
        self._sent = (len(self.text), len(self.tokens))
        return self.text[characters:], self.logprobs(tokens)
