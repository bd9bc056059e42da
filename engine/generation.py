"""Text generation over an `OffloadedModel`, as a generator of typed events.

`generate(model, prompt, config)` prefills the prompt in chunks, then decodes
(one token per target forward, or speculatively: several per verify step, see
`engine.speculative.decoder`) until EOS, a stop string, `max_new_tokens` or a cancel
request; it yields a `TokenEvent` per token (text deltas are always whole UTF-8
characters, and never part of a stop string) and ends with one
`FinishedEvent` carrying the text, the ids and the run's `GenerationStats`.
Cancellation is checked between tokens and acted on between steps, so the KV
cache is never left half-written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.constraints import ConstrainedSampler, request_grammar
from engine.errors import ContextLengthError, InvalidRequestError
from engine.generation_config import (
    CompletionPrompt,
    GenerationConfig,
    PromptEcho,
    TokenLogprob,
    forced_tool_names,
)
from engine.metrics import GenerationStats, LiveGeneration, cache_snapshot
from engine.model.prefix_cache import save_point
from engine.offloaded_model import OffloadedModel
from engine.sampling import LogprobTable, Sampler, prompt_logprobs
from engine.speculative.auto import refuse_speculation_that_cannot_rewind
from engine.speculative.decoder import open_decoder
from engine.text.prompt_ids import Message, encode_prompt, eos_token_ids
from engine.text.reasoning import harmony_splitter_for, splitter_for
from engine.text.stream import IncrementalDetokenizer, StopStringMatcher


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # new complete answer text since the previous event (may be "")
    index: int  # 0 for the first generated token
    elapsed_ms: float  # time since the previous token (the first: since the request)
    reasoning: str = ""  # new reasoning text (a `<think>` block), apart from the answer
    logprob: TokenLogprob | None = None  # when the request asks for logprobs
    echo: PromptEcho | None = None  # on the first event, when a completion prompt asks for its echo


@dataclass(frozen=True)
class FinishedEvent:
    reason: str  # "eos" | "stop" | "length" | "cancelled"
    text: str  # the whole answer
    tail: str  # text not yet sent in a TokenEvent (held back as a possible stop string or partial
    #            character until the end): a streaming consumer appends it
    token_ids: tuple[int, ...]
    stats: GenerationStats
    reasoning: str = ""  # the whole reasoning (its held-back tail is `reasoning_tail`)
    reasoning_tail: str = ""
    # calls the model wrote as messages of their own (gpt-oss's harmony), in a chat message's
    # `tool_calls` form; a `<tool_call>` block in the text is left to the reader
    tool_calls: tuple[dict[str, Any], ...] = ()


def generate(
    model: OffloadedModel,
    prompt: str | Sequence[Message] | Sequence[int] | CompletionPrompt,
    config: GenerationConfig = GenerationConfig(),
    cancel: threading.Event | None = None,
    live: LiveGeneration | None = None,
) -> Iterator[TokenEvent | FinishedEvent]:
    """Stream the reply to `prompt`; `cancel` stops it between steps; `live` keeps telemetry current."""
    config.validate()
    refuse_speculation_that_cannot_rewind(model, config.spec.mode)
    started = time.perf_counter()
    prompt_ids = encode_prompt(model, prompt, config.template_arguments())
    max_new_tokens = _max_new_tokens(model, config, len(prompt_ids))
    eos = set() if config.ignore_eos else eos_token_ids(model)
    sampler = _sampler(model, config, eos, prompt_ids)
    committed = _History(prompt_ids, model.device)
    completion = prompt if isinstance(prompt, CompletionPrompt) else None  # continued as written
    reply = _ReplyText(model.tokenizer, config.stop_strings, prompt_ids, split=completion is None)
    live = _begin(live or LiveGeneration(started), model, started, len(prompt_ids))
    rewindable = config.spec.mode != "none"
    echo = _Echo(prompt_ids, config.logprobs) if completion is not None and completion.echo else None
    kv_cache, reused = _kv_cache(model, prompt_ids, rewindable, live, reuse=echo is None or echo.top is None)
    decoder = live.decoder = open_decoder(
        model, config.spec, config.prefetch, config.cutoff, sampler, config.cpu_experts
    )
    try:
        logits = _prefill(model, committed.tokens[reused:], kv_cache, config.prefill_chunk, echo)
        prompt_state = save_point(kv_cache)  # a regenerate or an edited turn goes back to it
        live.prefilled = time.perf_counter()
        echoed = echo.event(model.tokenizer) if echo is not None else None
        generated: list[int] = []
        # the first token's latency counts from the request
        new_tokens, last = [sampler.sample(logits, committed.tokens)], started
        reason = None
        while reason is None:
            for token in new_tokens:
                logprob = _logprob(model, sampler.logprobs, committed.length, token, eos)
                generated.append(token)
                live.generated = len(generated)
                committed.append(token)
                thought, delta, stopped = reply.push(token, token in eos)
                now = time.perf_counter()
                yield TokenEvent(
                    token, delta, live.generated - 1, (now - last) * 1e3, thought, logprob, echoed
                )
                last, echoed = now, None
                reason = _end_reason(stopped, token in eos, len(generated), max_new_tokens, cancel)
                if reason is not None:
                    break
            if reason is None:
                history = committed.tokens if decoder.reads_history else None
                new_tokens = decoder.step(history, kv_cache, max_new_tokens - len(generated), token)
        live.finished = time.perf_counter()
    finally:
        decoder.close()  # uninstalls the prefetch policy; unused prefetches are counted as wasted
    # kept only after a clean end (a cancel comes between steps): a failed step's cache is dropped
    model.prefix_cache.put(committed.tokens.tolist(), kv_cache, rewindable, [p for p in [prompt_state] if p])

    stats = live.stats(model.cache, live.finished, model.simulated_link)  # the run's final figures
    yield reply.finished(reason, generated, stats)


def _sampler(
    model: OffloadedModel, config: GenerationConfig, eos: set[int], prompt_ids: list[int]
) -> Sampler:
    """The request's sampler, keeping log-probabilities when the request asks for them; held to a
    grammar when its response_format or tool_choice asks for one."""
    vocab_size = model.hf_config.vocab_size
    beyond = [token for token, _ in config.sampling.logit_bias if token >= vocab_size]
    if beyond:
        raise InvalidRequestError(
            f"logit_bias names token {beyond[0]}, but this model's tokens are 0 to {vocab_size - 1}."
        )
    sampler = Sampler(config.sampling, device=model.device, prompt_tokens=len(prompt_ids))
    constrained = config.response_format is not None or forced_tool_names(config.tool_choice, config.tools)
    if config.logprobs is not None:
        sampler.keep_logprobs(LogprobTable(config.logprobs))
    if not constrained:
        return sampler
    if model.tokenizer is None:
        raise InvalidRequestError(f"{model.path} has no tokenizer: response_format and tool_choice need one.")
    grammar = request_grammar(config, model.tokenizer, prompt_ids)
    if grammar is None:
        return sampler
    if config.spec.mode != "none":
        raise InvalidRequestError(f"A {grammar[1]} reply decodes plainly: set speculation to none.")
    budget = config.max_new_tokens
    return ConstrainedSampler(sampler, model.tokenizer, vocab_size, eos, grammar, budget)


def _logprob(
    model: OffloadedModel, table: LogprobTable | None, position: int, token: int, eos
) -> TokenLogprob | None:
    """`token`'s log-probability at `position` and the top alternatives' (None when the request
    asks for none, and for the end-of-reply token, which is not part of the reply's text)."""
    if table is None or token in eos:
        return None
    return _spelt(model.tokenizer, token, *table.take(position, token))


def _spelt(tokenizer, token: int, logprob: float, top: tuple[tuple[int, float], ...]) -> TokenLogprob:
    """A token's log-probability with it and its alternatives spelled as text."""
    spell = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    return TokenLogprob(spell(token), logprob, tuple((spell(t), lp) for t, lp in top))


def _begin(live: LiveGeneration, model: OffloadedModel, started: float, prompt_tokens: int) -> LiveGeneration:
    """Telemetry's starting point: the cache's counters and the paths' log as the request found them."""
    live.started, live.kernels = started, model.config.kernels
    live.before, live.prompt_tokens = cache_snapshot(model.cache), prompt_tokens
    live.steps, live.steps_before = model.paths.log, model.paths.log.snapshot()
    return live


def _kv_cache(
    model: OffloadedModel, prompt_ids: list[int], rewindable: bool, live: LiveGeneration, reuse: bool
):
    """A kept cache holding the longest prefix of the prompt, and its length (told to `live`);
    else (or when the prompt must be run whole: `reuse` False) a fresh one."""
    kv_cache, reused = model.prefix_cache.take(prompt_ids, rewindable) if reuse else (None, 0)
    live.cached_prompt_tokens = reused if kv_cache is not None else 0
    return (kv_cache, reused) if kv_cache is not None else (model.new_kv_cache(rewindable), 0)


def _max_new_tokens(model: OffloadedModel, config: GenerationConfig, prompt_tokens: int) -> int:
    """`config.max_new_tokens`, capped so the prompt and the reply fit the context window (the
    model's, or the request's when smaller): a model reads garbage past the positions it learnt."""
    loaded = model.config.context_length  # the context length the model was loaded with
    windows = [w for w in (model.context_length, loaded, config.context_length) if w is not None]
    if not windows:
        return config.max_new_tokens
    window = min(windows)
    if prompt_tokens >= window:
        if window == model.context_length:
            limit = f"This model's maximum context length is {window} tokens."
            advice = "Shorten the conversation or start a new one."
        else:
            model_window = f" (the model's is {model.context_length})" if model.context_length else ""
            limit = f"This request's context limit is {window} tokens{model_window}."
            advice = "Shorten the conversation, start a new one or raise the limit."
            if window == loaded:  # the user's setting, not this request's
                limit = f"The model is loaded with a context length of {window} tokens{model_window}."
                advice = "Shorten the conversation, start a new one or raise the context length setting."
        raise ContextLengthError(
            f"{limit} However, your messages resulted in {prompt_tokens} tokens. {advice}",
            context_length=window,
            prompt_tokens=prompt_tokens,
        )
    return min(config.max_new_tokens, window - prompt_tokens)


def _prefill(
    model: OffloadedModel, ids: torch.Tensor, kv_cache, chunk: int, echo: _Echo | None
) -> torch.Tensor:
    """Run the prompt through the model in chunks; the last position's logits (and, when `echo`
    scores the prompt, every position's, kept there)."""
    scores = echo is not None and echo.top is not None
    with model.cache.in_phase("prefill"):
        for start in range(0, len(ids), chunk):
            logits = model.forward(ids[start : start + chunk], kv_cache, logits_to_keep=0 if scores else 1)
            if scores:
                echo.score(logits, ids[start + 1 : start + chunk + 1])
    return logits[-1]


class _Echo:
    """A completion prompt to send back; with `top` (the request's logprobs), each prompt token's
    log-probability from the prefill's logits (the prompt is then run whole: no kept prefix)."""

    def __init__(self, prompt_ids: list[int], top: int | None):
        self.ids, self.top = prompt_ids, top
        self.scored: list[tuple[float, tuple[tuple[int, float], ...]]] = []

    def score(self, logits: torch.Tensor, next_ids: torch.Tensor) -> None:
        self.scored += prompt_logprobs(logits, next_ids, self.top)

    def event(self, tokenizer) -> PromptEcho:
        text = tokenizer.decode(self.ids) if tokenizer is not None else " ".join(map(str, self.ids))
        tokens = tuple(tokenizer.decode([t]) if tokenizer is not None else str(t) for t in self.ids)
        if self.top is None:
            return PromptEcho(text, tokens)
        scored = [_spelt(tokenizer, t, *entry) for t, entry in zip(self.ids[1:], self.scored, strict=True)]
        return PromptEcho(text, tokens, (None, *scored))


def _end_reason(stopped: bool, is_eos: bool, generated: int, limit: int, cancel) -> str | None:
    if stopped:
        return "stop"
    if is_eos:
        return "eos"
    if generated >= limit:
        return "length"
    if cancel is not None and cancel.is_set():
        return "cancelled"
    return None


class _History:
    """Every committed token id, `tokens [L]` on the model's device, appended to in place: one
    element written into a buffer that doubles when full (a `torch.cat` a token costs a CPU decode
    step more), the view made when read. A view handed out never changes: later
    tokens lie past its end."""

    def __init__(self, ids: Sequence[int], device: torch.device):
        self._buffer = torch.tensor(ids, dtype=torch.long, device=device)
        self._host = self._buffer.numpy() if self._buffer.is_cpu else None  # written through numpy
        self._length = self._capacity = len(ids)
        self._tokens: torch.Tensor | None = self._buffer

    @property
    def length(self) -> int:
        return self._length

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = self._buffer[: self._length]
        return self._tokens

    def append(self, token: int) -> None:
        """`token` after the others."""
        length = self._length
        if length == self._capacity:
            self._capacity = max(16, 2 * length)
            grown = self._buffer.new_empty(self._capacity)
            grown[:length] = self._buffer
            self._buffer, self._host = grown, grown.numpy() if grown.is_cpu else None
        if self._host is not None:
            self._host[length] = token
        else:
            self._buffer[length] = token
        self._length, self._tokens = length + 1, None


class _ReplyText:
    """The reply's text as tokens arrive: whole characters, stop strings held back and matched,
    the reasoning (a `<think>` block, or gpt-oss's analysis channel) apart from the answer."""

    def __init__(self, tokenizer, stop_strings: Sequence[str], prompt_ids: Sequence[int], split: bool = True):
        """`split` False: the text as the model writes it, reasoning and all (a completion prompt's)."""
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopStringMatcher(stop_strings)
        self.harmony = harmony_splitter_for(tokenizer) if split else None  # gpt-oss: channels, not tags
        self.thoughts = splitter_for(tokenizer, prompt_ids) if split and self.harmony is None else None
        self.answers: list[str] = []
        self.thinking: list[str] = []

    def push(self, token: int, is_eos: bool) -> tuple[str, str, bool]:
        """(reasoning delta, answer delta, a stop string ended the reply)."""
        if self.detok is None or is_eos:
            return "", "", False
        text, stopped = self.stops.feed(self.detok.push(token))
        return (*self._split(text, token), stopped)

    def finish(self, reason: str) -> tuple[str, tuple[str, str]]:
        """The final reason and the text held back till the end (a partial character or a possible
        stop string or tag), as (reasoning, answer)."""
        tail = ""
        if reason != "stop" and self.detok is not None:
            tail, stopped = self.stops.feed(self.detok.flush())
            tail += self.stops.flush()
            reason = "stop" if stopped else reason
        thought, answer = self._split(tail)
        if self.thoughts is not None:
            more_thought, more_answer = self.thoughts.flush()
            thought, answer = thought + more_thought, answer + more_answer
            self.thinking.append(more_thought)
            self.answers.append(more_answer)
        if self.harmony is not None:
            self.harmony.finish()
        return reason, (thought, answer)

    def finished(self, reason: str, generated: list[int], stats: GenerationStats) -> FinishedEvent:
        """The reply's last event: its text, with what was held back till the end, and its calls."""
        reason, (thought_tail, tail) = self.finish(reason)
        answer, reasoning, ids = self.answer, self.reasoning, tuple(generated)
        return FinishedEvent(reason, answer, tail, ids, stats, reasoning, thought_tail, self.calls)

    def _split(self, text: str, token: int = -1) -> tuple[str, str]:
        """`text` (that `token` completed; -1: the end's held-back text) as (reasoning, answer)."""
        if self.harmony is not None:
            thought, answer = self.harmony.push(token, text)
        else:
            thought, answer = self.thoughts.feed(text) if self.thoughts is not None else ("", text)
        self.thinking.append(thought)
        self.answers.append(answer)
        return thought, answer

    @property
    def answer(self) -> str:
        return "".join(self.answers)

    @property
    def reasoning(self) -> str:
        return "".join(self.thinking)

    @property
    def calls(self) -> tuple[dict[str, Any], ...]:
        return self.harmony.tool_calls() if self.harmony is not None else ()


def generate_text(model: OffloadedModel, prompt, config: GenerationConfig = GenerationConfig()):
    """Run to completion; the `FinishedEvent`."""
    for event in generate(model, prompt, config):
        if isinstance(event, FinishedEvent):
            return event
    raise AssertionError("generate() ended without a FinishedEvent")


__all__ = [
    "FinishedEvent",
    "GenerationConfig",
    "TokenEvent",
    "encode_prompt",
    "generate",
    "generate_text",
]
