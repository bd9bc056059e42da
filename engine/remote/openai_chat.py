"""One reply from an OpenAI-compatible server, in the worker protocol's terms.

`chat_arguments` turns a `Generate` (messages and `GenerationConfig`) into the arguments of
`client.chat.completions.create(stream=True)`: sampling, stop strings, tools, response_format,
and `chat_template_kwargs` (the Think toggle), which vLLM, SGLang and MoE Chat's server take;
top_k and repetition_penalty go as the extra fields those servers read. What only the local
engine has (speculation, prefetch, offload, a smaller context window) is not sent.

`ReplyAssembler` reads the streamed chunks: answer text and reasoning (`reasoning_content`, or
vLLM's newer `reasoning`) become `Token` events, tool-call deltas are joined by index, and
`finish` gives the `Finished` with the whole text, the calls, the usage and client-side
timing. Remote finish reasons map to the local ones: stop → eos, length → length; tool_calls,
cancelled and interrupted (the stream was cut; `stats["error"]` says why) are kept as such.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from engine.generation_config import GenerationConfig
from engine.worker.protocol import ChatMessage, Finished, Token, TokenLogprob

FINISH_REASONS = {
    "stop": "eos",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
}


def wire_message(message: ChatMessage) -> dict[str, Any]:
    """A protocol message as the OpenAI API takes it: tool-call arguments as a JSON string."""
    wire: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        wire["tool_calls"] = [_wire_call(call) for call in message.tool_calls]
        wire["content"] = message.content or None
    if message.tool_call_id is not None:
        wire["tool_call_id"] = message.tool_call_id
    return wire


def _wire_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments", {})
    function["arguments"] = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call.get("id", ""), "type": "function", "function": function}


def chat_arguments(model: str, messages: tuple[ChatMessage, ...], config: GenerationConfig) -> dict[str, Any]:
    """Keyword arguments of `chat.completions.create` for this request, streamed with usage."""
    sampling = config.sampling
    arguments: dict[str, Any] = {
        "model": model,
        "messages": [wire_message(m) for m in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": config.max_new_tokens,
        "temperature": 0.0 if sampling.is_greedy else sampling.temperature,
    }
    if sampling.top_p < 1.0:
        arguments["top_p"] = sampling.top_p
    if sampling.seed is not None:
        arguments["seed"] = sampling.seed
    if config.stop_strings:
        arguments["stop"] = list(config.stop_strings)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(sampling, name):
            arguments[name] = getattr(sampling, name)
    if sampling.logit_bias:
        arguments["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias}
    if config.tools:
        arguments["tools"] = list(config.tools)
    if config.response_format is not None:
        arguments["response_format"] = config.response_format
    if config.logprobs is not None:
        arguments.update(logprobs=True, top_logprobs=config.logprobs)
    extra: dict[str, Any] = {}
    if sampling.top_k > 0 and not sampling.is_greedy:
        extra["top_k"] = sampling.top_k
    if sampling.min_p > 0 and not sampling.is_greedy:
        extra["min_p"] = sampling.min_p
    if sampling.repetition_penalty != 1.0:
        extra["repetition_penalty"] = sampling.repetition_penalty
    if config.template_kwargs:
        extra["chat_template_kwargs"] = dict(config.template_kwargs)
    if extra:
        arguments["extra_body"] = extra
    return arguments


@dataclass
class _CallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)

    def call(self, index: int) -> dict[str, Any]:
        text = "".join(self.arguments)
        try:
            arguments: Any = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            arguments = text  # kept as written: the front end shows it, the remote gets it back as is
        return {
            "id": self.id or f"call_{index}",
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


class ReplyAssembler:
    """The events of one streamed reply; `feed` each chunk, then `finish` once."""

    def __init__(self, request_id: str, started: float | None = None):
        self.request_id = request_id
        self.started = time.perf_counter() if started is None else started
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, _CallParts] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None
        self.chunks = 0  # chunks that carried text or reasoning: the token count without usage
        self.first_at: float | None = None
        self.last_at = self.started

    @property
    def received(self) -> bool:
        """Whether any of the reply has arrived (a lost connection is then a cut stream)."""
        return self.first_at is not None or bool(self.calls)

    def feed(self, chunk: Any) -> Token | None:
        """The `Token` for one chunk, or None for a chunk with no text (role, usage, tool calls)."""
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
            self.usage = {
                "prompt_tokens": usage.prompt_tokens or 0,
                "completion_tokens": usage.completion_tokens or 0,
            }
        if not chunk.choices:
            return None
        choice = chunk.choices[0]
        if choice.finish_reason:
            self.finish_reason = choice.finish_reason
        delta = choice.delta
        if delta is None:
            return None
        for part in delta.tool_calls or ():
            parts = self.calls.setdefault(part.index, _CallParts())
            parts.id = part.id or parts.id
            if part.function is not None:
                parts.name += part.function.name or ""
                parts.arguments.append(part.function.arguments or "")
        text = delta.content or ""
        reasoning = _reasoning(delta)
        logprobs = _logprobs(choice)
        if not text and not reasoning and not logprobs:
            return None
        now = time.perf_counter()
        if self.first_at is None:
            self.first_at = now
        elapsed_ms = (now - self.last_at) * 1000
        token = Token(self.request_id, text, -1, self.chunks, elapsed_ms, reasoning, logprobs)
        self.chunks += 1
        self.last_at = now
        self.text.append(text)
        self.reasoning.append(reasoning)
        return token

    def finish(self, reason: str | None = None, error: dict[str, Any] | None = None) -> Finished:
        """The reply's end: `reason` overrides the remote's (cancelled, interrupted), `error` says why."""
        if reason is None:
            reason = FINISH_REASONS.get(self.finish_reason or "", self.finish_reason or "eos")
        calls = tuple(self.calls[i].call(i) for i in sorted(self.calls))
        stats = self.timing()
        if error is not None:
            stats["error"] = error
        return Finished(
            self.request_id,
            reason,
            "".join(self.text),
            "",  # every piece went out in a Token already
            self.usage["prompt_tokens"] if self.usage else 0,
            self.usage["completion_tokens"] if self.usage else self.chunks,
            stats,
            "".join(self.reasoning),
            "",
            calls,
        )

    def timing(self) -> dict[str, Any]:
        """Client-side figures: time to first token, and decode speed after it (DESIGN.md's tpot_ms)."""
        tokens = self.usage["completion_tokens"] if self.usage else self.chunks
        ttft_ms = None if self.first_at is None else (self.first_at - self.started) * 1000
        decode_s = None if self.first_at is None else self.last_at - self.first_at
        tpot_ms = decode_s * 1000 / (tokens - 1) if decode_s and tokens > 1 else None
        return {
            "ttft_ms": ttft_ms,
            "tpot_ms": tpot_ms,
            "tokens_per_s": 1000 / tpot_ms if tpot_ms else None,
            "generated_tokens": tokens,
            "tokens_counted_by": "usage" if self.usage else "chunks",
        }


def _logprobs(choice: Any) -> tuple[TokenLogprob, ...]:
    """The chunk's tokens' log-probabilities, where the request asked for them and the server sent them."""
    content = getattr(getattr(choice, "logprobs", None), "content", None) or ()
    return tuple(
        TokenLogprob(e.token, e.logprob, tuple((t.token, t.logprob) for t in e.top_logprobs or ()))
        for e in content
    )


def _reasoning(delta: Any) -> str:
    """The chunk's reasoning: `reasoning_content` (SGLang, llama.cpp, MoE Chat, older vLLM) or `reasoning`."""
    for name in ("reasoning_content", "reasoning"):
        value = getattr(delta, name, None)
        if value is None and delta.model_extra:
            value = delta.model_extra.get(name)
        if isinstance(value, str) and value:
            return value
    return ""
