"""The shapes OpenAI's responses share: an envelope's id and time, a streamed chunk, `usage`, and
the `stats` MoE Chat adds beside it (the drafter, the prefetch policy, the kernels and the DESIGN.md
metrics of the reply)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from engine.worker.protocol import Finished, TokenLogprob

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


def chunk(head: dict, delta: dict, finish_reason: str | None = None) -> dict[str, Any]:
    """A streamed chat-completion chunk: the reply's `envelope` and one choice's delta."""
    return {
        **head,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
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


def usage(finished: Finished) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: prompt tokens a kept KV cache held (not prefilled again)."""
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.completion_tokens,
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.stats.get("cached_prompt_tokens", 0)},
    }


def logprob_content(entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list[dict[str, Any]]:
    """Tokens' log-probabilities as OpenAI's `logprobs.content` entries."""
    return [
        {**_logprob(e.token, e.logprob), "top_logprobs": [_logprob(t, lp) for t, lp in e.top]}
        for e in entries
    ]


def _logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": max(logprob, LEAST_LOGPROB), "bytes": list(token.encode("utf-8"))}
