"""Next-token sampling: exactly the distribution transformers' `generate()` samples from.

Contract: `Sampler.probs(logits, history)` returns the float32 distribution that
`model.generate(do_sample=True, temperature=..., top_k=..., top_p=..., min_p=..., repetition_penalty=...)`
draws the next token from. It is built from transformers' own logits processors, in the order
`GenerationMixin._get_logits_processor` appends them (each only when it changes something):

    RepetitionPenaltyLogitsProcessor  (repetition_penalty != 1.0; before the sampling warpers)
    TemperatureLogitsWarper           (temperature != 1.0)
    TopKLogitsWarper                  (top_k != 0)
    TopPLogitsWarper                  (top_p < 1.0)
    MinPLogitsWarper                  (min_p > 0)

OpenAI's `logit_bias`, then its `presence_penalty` / `frequency_penalty` (which transformers does
not have) come first, as vLLM applies them: a bias is added to its token's logit; a token the
reply has generated `c` times loses `c · frequency_penalty + presence_penalty` (the prompt's
tokens do not count: the sampler is told where the reply starts).

Greedy decoding (`greedy=True` or `temperature == 0`) applies only the repetition penalty, as
`generate(do_sample=False)` does, and its distribution is the one-hot of the argmax. `sample`
draws from `probs` with `torch.multinomial`; the two stay apart so speculative rejection
sampling can reuse `probs` for both the draft and the target.
"""

from __future__ import annotations

import logging

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.generation_config import SamplingConfig

logger = logging.getLogger(__name__)


def build_logits_processors(config: SamplingConfig, prompt_tokens: int = 0) -> LogitsProcessorList:
    """The processors transformers' generate() would apply for `config`, in its order, after
    OpenAI's bias and penalties; the reply starts after `prompt_tokens` of the history."""
    processors = LogitsProcessorList()
    if config.logit_bias:
        processors.append(LogitBias(config.logit_bias))
    if config.penalizes:
        processors.append(ReplyPenalties(config.presence_penalty, config.frequency_penalty, prompt_tokens))
    if config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(float(config.repetition_penalty)))
    if config.is_greedy:  # generate(do_sample=False) skips the sampling warpers
        return processors
    if config.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(float(config.temperature)))
    if config.top_k != 0:
        processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=float(config.top_p), min_tokens_to_keep=1))
    if config.min_p > 0:
        processors.append(MinPLogitsWarper(min_p=float(config.min_p), min_tokens_to_keep=1))
    return processors


class LogitBias:
    """OpenAI's `logit_bias`: each listed token's logit plus its bias."""

    def __init__(self, bias: tuple[tuple[int, float], ...]):
        self.ids = torch.tensor([token for token, _ in bias], dtype=torch.long)
        self.values = torch.tensor([value for _, value in bias], dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.ids.to(scores.device)] += self.values.to(scores.device, scores.dtype)
        return scores


class ReplyPenalties:
    """OpenAI's presence and frequency penalties over the reply's tokens (those after the prompt)."""

    def __init__(self, presence: float, frequency: float, prompt_tokens: int):
        self.presence, self.frequency, self.prompt_tokens = presence, frequency, prompt_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        reply = input_ids[0, self.prompt_tokens :]
        if reply.numel() == 0:
            return scores
        vocab = scores.shape[-1]
        counts = torch.bincount(reply.clamp(max=vocab - 1), minlength=vocab)[:vocab].to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class Sampler:
    """Turns next-position logits into a distribution (`probs`) and a token (`sample`).

    `device` is where the logits live: a seeded generator must sit on the same device as the
    probabilities `torch.multinomial` draws from. `prompt_tokens` is the prompt's length: a
    `history` after it is the reply, which OpenAI's penalties count.
    """

    def __init__(
        self, config: SamplingConfig, device: torch.device | str = "cpu", prompt_tokens: int = 0
    ) -> None:
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.prompt_tokens = prompt_tokens  # where the reply starts in a `history` (the penalties read it)
        self._processors = build_logits_processors(config, prompt_tokens)
        self._generator: torch.Generator | None = None
        if config.seed is not None:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(config.seed)
        # greedy on the logits as they are: their argmax, read through numpy (`_argmax`)
        self._argmax_only = config.is_greedy and self._plain()
        self.reads_history = not self._argmax_only  # `sample`'s `history` may be None where it does not
        self._read: tuple[torch.Tensor | None, object] = (None, None)  # the last logits, as numpy reads them
        self.logprobs: LogprobTable | None = None  # set by `keep_logprobs`
        logger.debug("sampler %s with processors %s", config, [type(p).__name__ for p in self._processors])

    def keep_logprobs(self, table: LogprobTable) -> None:
        """From now on keep in `table` the log-probabilities each sampled position was drawn from
        (the processed scores', as vLLM reports them): a reply's logprobs, with no extra forward."""
        self.logprobs = table
        self._argmax_only = False
        self.reads_history = True  # a position is the length of the history before it

    def _kept(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """`_scores`, kept in the log-probability table when there is one."""
        scores = self._scores(logits, history)
        if self.logprobs is not None:
            self.logprobs.keep(len(history), scores[0])
        return scores

    @property
    def generator(self) -> torch.Generator | None:
        """The seeded generator draws come from (None: torch's global one)."""
        return self._generator

    def _scores(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Processed float32 scores [1, V], as generate() computes them before the softmax."""
        scores = logits.to(dtype=torch.float32).reshape(1, -1)  # [1, V]
        input_ids = history.to(device=scores.device, dtype=torch.long).reshape(1, -1)  # [1, L]
        # Called one by one: LogitsProcessorList.__call__ inspects each signature on every call,
        # which costs more than the processing itself at this size.
        for processor in self._processors:
            scores = processor(input_ids, scores)
        return scores

    def probs(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Next-token distribution [V] (float32) for `logits` [V], given all ids so far `history` [L]."""
        scores = self._kept(logits, history)  # [1, V]
        if self.config.is_greedy:
            one_hot = torch.zeros_like(scores[0])
            one_hot[scores[0].argmax()] = 1.0
            return one_hot
        return torch.softmax(scores, dim=-1)[0]

    def greedy_scores(self, logits: torch.Tensor, context: torch.Tensor, committed: int) -> torch.Tensor:
        """Scores `[n, V]` whose argmax a greedy step takes at each of `logits`' rows (row i after
        `context[: committed + i]`): the logits themselves where nothing changes them."""
        if self._plain() and self.logprobs is None:
            return logits
        return torch.cat([self._kept(logits[i], context[: committed + i]) for i in range(len(logits))])

    def _argmax(self, logits: torch.Tensor) -> int:
        """`argmax(logits)`; the logits a decode step gives are the same tensor step after step (a
        buffer it rewrites), whose numpy view is kept: with the caches cold from the step's weights
        making it again is a large share of a greedy token's sampling."""
        tensor, array = self._read
        if tensor is not logits:
            if not _numpy_reads(logits):
                return argmax(logits)
            array = logits.numpy()
            self._read = (logits, array)
        return int(array.argmax())

    def _plain(self) -> bool:
        """Whether the scores are the logits: no processor, no subclass's mask (a float32 copy
        keeps their argmax)."""
        return not self._processors and type(self)._scores is Sampler._scores

    def sample(self, logits: torch.Tensor, history: torch.Tensor | None) -> int:
        """Draw the next token id (the argmax when greedy)."""
        if self._argmax_only:
            return self._argmax(logits)
        scores = self._kept(logits, history)  # [1, V]
        if self.config.is_greedy:  # scores a processor, a subclass's mask or the table needs (else above)
            return argmax(scores[0])
        probs = torch.softmax(scores, dim=-1)[0]  # [V]
        return int(torch.multinomial(probs, 1, generator=self._generator))


class LogprobTable:
    """The log-probabilities of sampled positions (by position: the tokens before it), kept until
    their token is known; `take` gives a token's and the `top` likeliest alternatives'."""

    def __init__(self, top: int):
        self.top = top
        self.rows: dict[int, torch.Tensor] = {}

    def keep(self, position: int, scores: torch.Tensor) -> None:
        self.rows[position] = torch.log_softmax(scores.to(torch.float32), dim=-1)  # [V]

    def take(self, position: int, token: int) -> tuple[float, tuple[tuple[int, float], ...]]:
        """(the token's log-probability, the top alternatives as (id, log-probability) pairs);
        the rows of this position and those before it are let go."""
        row = self.rows.get(position)
        for kept in [p for p in self.rows if p <= position]:
            del self.rows[kept]
        if row is None:
            raise RuntimeError(f"no log-probabilities were kept for position {position}")
        return float(row[token]), _likeliest(row, self.top) if self.top else ()


def prompt_logprobs(
    logits: torch.Tensor, next_ids: torch.Tensor, top: int
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """The log-probabilities a prompt's positions gave the tokens that follow them: row i of
    `logits [n, V]` (the raw logits, no processors: nothing was sampled there) scores `next_ids[i]`;
    with the `top` likeliest alternatives each. `next_ids` may be a row shorter (the prompt's end)."""
    rows = torch.log_softmax(logits[: len(next_ids)].to(torch.float32), dim=-1)
    chosen = rows.gather(1, next_ids.view(-1, 1).to(rows.device))[:, 0].tolist()
    return [(lp, _likeliest(row, top) if top else ()) for lp, row in zip(chosen, rows, strict=True)]


def _likeliest(row: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` likeliest (id, log-probability) pairs of `row`, ties in id order as `argmax` breaks
    them (so a greedy token is first); `topk` leaves ties' order unspecified."""
    threshold = row.topk(min(k, row.numel())).values[-1]
    ids = (row >= threshold).nonzero()[:, 0]  # k of them, and any tied with the k-th
    order = sorted(zip(ids.tolist(), row[ids].tolist(), strict=True), key=lambda pair: (-pair[1], pair[0]))
    return tuple(order[:k])


def argmax(scores: torch.Tensor) -> int:
    """The index of the first largest of `scores [V]`, as `torch.argmax` gives it: numpy's for
    float32 on the CPU, where torch's is many times slower over a large vocabulary."""
    if _numpy_reads(scores):
        return int(scores.numpy().argmax())
    return int(scores.argmax())


def argmaxes(scores: torch.Tensor) -> list[int]:
    """`argmax` of each row of `scores [n, V]`."""
    if _numpy_reads(scores):
        return scores.numpy().argmax(axis=-1).tolist()
    return scores.argmax(dim=-1).tolist()


def _numpy_reads(scores: torch.Tensor) -> bool:
    return scores.is_cpu and scores.dtype == torch.float32 and not scores.requires_grad
