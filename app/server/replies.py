"""The shapes OpenAI's responses share: an envelope's id and time, a streamed chunk, `usage`, and
the `stats` MoE Chat adds beside it (the drafter, the prefetch policy, the kernels and the DESIGN.md
metrics of the reply); a chat reply's message, finish reason, logprobs and streamed chunks."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

from app.server.tool_calls import ToolCallStream, engine_calls, split_calls
from engine.worker.protocol import Finished, Token, TokenLogprob

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
LEAST_LOGPROB = -9999.0  # what an impossible token's log-probability reads as (JSON has no -inf)


def envelope(kind: str, model: str) -> dict[str, Any]:
    """What every response and chunk of one reply carries: its id, kind, time and model."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }


def chunk(head: dict, delta: dict, finish_reason: str | None = None, index: int = 0) -> dict[str, Any]:
    """A streamed chat-completion chunk: the reply's `envelope` and one choice's delta."""
    return {
        **head,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


STATS_KEYS = (
    "tpot_ms",
    "tokens_per_s",
    "prefill_tokens_per_s",
    "accept_len",
    "acceptance_rate",
    "draft_len",
    "hit_rate",
    "h2d_gbps",
    "prefetch_precision",
    "prefetch_recall",
    "lossless",
    "simulated_link",
    "kernels",  # what computed the model on the CPU: ggml (llama.cpp's) or exact
)


def engine_stats(finished: Finished) -> dict[str, Any]:
    """MoE Chat's figures for the reply (beside OpenAI's `usage`, as llama.cpp adds `timings`):
    which drafter and prefetch policy ran, the kernels, and the DESIGN.md metrics."""
    stats = finished.stats
    return {
        "drafter": stats.get("spec"),
        "prefetch": stats.get("prefetch"),
        **{key: stats.get(key) for key in STATS_KEYS},
    }


def usage(finished: list[Finished], n: int = 1) -> dict[str, Any]:
    """OpenAI's usage of replies to prompts that had `n` choices each: a prompt counts once, every
    choice's tokens count; `cached_tokens`: prompt tokens a kept KV cache held (not prefilled again)."""
    prompts = finished[::n]
    prompt_tokens = sum(f.prompt_tokens for f in prompts)
    completion_tokens = sum(f.completion_tokens for f in finished)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(f.stats.get("cached_prompt_tokens", 0) for f in prompts)
        },
    }


def logprob_content(entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    """Tokens' log-probabilities as OpenAI's `logprobs.content` entries."""
    return [
        {**_logprob(e.token, e.logprob), "top_logprobs": [_logprob(t, lp) for t, lp in e.top]}
        for e in entries
    ]


def _logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode("utf-8"))}


def finite(logprob: float) -> float:
    """A log-probability JSON can carry: an impossible token's -inf as `LEAST_LOGPROB`."""
    return max(logprob, LEAST_LOGPROB)


def chat_message(finished: Finished, tools: bool) -> dict[str, Any]:
    """The reply's message; a model's reasoning (its `<think>` block) is `reasoning_content`, as
    vLLM, SGLang and DeepSeek's API return it; the calls it wrote, when it was given tools, are
    `tool_calls` (content None when nothing else was said)."""
    content, calls = split_calls(finished.text) if tools else (finished.text, [])
    calls += engine_calls(finished.tool_calls)
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if finished.reasoning:
        message["reasoning_content"] = finished.reasoning
    return message


def chat_logprobs(entries) -> dict[str, Any]:
    """A chat choice's `logprobs`: its tokens' entries."""
    return {"content": logprob_content(entries), "refusal": None}


def finish_reason(finished: Finished, called: bool = False) -> str:
    """OpenAI's finish reason for the engine's: stop, tool_calls when calls were made, and length
    when the token limit cut the reply (a call it cut is partial: the client must know)."""
    if finished.reason == "length":
        return "length"
    return "tool_calls" if called else FINISH_REASONS.get(finished.reason, "stop")


def _deltas(reasoning: str, text: str) -> Iterator[dict[str, str]]:
    if reasoning:
        yield {"reasoning_content": reasoning}
    if text:
        yield {"content": text}


def event_chunks(
    head: dict, event: Token | Finished, calls: ToolCallStream | None, index: int
) -> Iterator[dict[str, Any]]:
    """A streamed event's chunks; with tools, text from a `<tool_call>` on is held and its calls
    are sent whole before the last chunk."""
    if isinstance(event, Token):
        text = calls.feed(event.text) if calls is not None else event.text
        chunks = [chunk(head, delta, index=index) for delta in _deltas(event.reasoning, text)]
        if event.logprobs:  # on the event's first chunk; an empty one where its text is held back
            chunks = chunks or [chunk(head, {"content": ""}, index=index)]
            chunks[0]["choices"][0]["logprobs"] = chat_logprobs(event.logprobs)
        yield from chunks
        return
    tail, made = event.tail, []
    if calls is not None:
        tail = calls.feed(tail)
        rest, made = calls.finish()
        tail += rest
    made += engine_calls(event.tool_calls)
    for delta in _deltas(event.reasoning_tail, tail):
        yield chunk(head, delta, index=index)
    if made:
        yield chunk(head, {"tool_calls": [{"index": n, **call} for n, call in enumerate(made)]}, index=index)
    yield {**chunk(head, {}, finish_reason(event, bool(made)), index), "stats": engine_stats(event)}
