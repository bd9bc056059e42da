"""Next-token sampling: exactly the distribution transformers' `generate()` samples from.

Contract: `Sampler.probs(logits, history)` returns the float32 distribution that
`model.generate(do_sample=True, temperature=..., top_k=..., top_p=..., repetition_penalty=...)`
draws the next token from. It is built from transformers' own logits processors, in the order
`GenerationMixin._get_logits_processor` appends them (each only when it changes something):

    RepetitionPenaltyLogitsProcessor  (repetition_penalty != 1.0; before the sampling warpers)
    TemperatureLogitsWarper           (temperature != 1.0)
    TopKLogitsWarper                  (top_k != 0)
    TopPLogitsWarper                  (top_p < 1.0)

Greedy decoding (`greedy=True` or `temperature == 0`) applies only the repetition penalty, as
`generate(do_sample=False)` does, and its distribution is the one-hot of the argmax. `sample`
draws from `probs` with `torch.multinomial`; the two stay apart so speculative rejection
sampling can reuse `probs` for both the draft and the target.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen; the defaults match a typical chat setting."""

    temperature: float = 0.7  # 0 (or greedy=True) means greedy decoding
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1.0 = off
    top_k: int = 0  # 0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; > 1 discourages tokens already in the history
    seed: int | None = None  # None = torch's global generator
    greedy: bool = False

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first option outside its allowed range."""
        if not _is_real(self.temperature) or not self.temperature >= 0:
            raise InvalidRequestError(
                f"temperature must be a number >= 0 (0 means greedy), got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if not _is_real(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise InvalidRequestError(
                f"repetition_penalty must be a number > 0 (1 turns it off), got {self.repetition_penalty!r}"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequestError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def build_logits_processors(config: SamplingConfig) -> LogitsProcessorList:
    """The processors transformers' generate() would apply for `config`, in its order."""
    processors = LogitsProcessorList()
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
    return processors


class Sampler:
    """Turns next-position logits into a distribution (`probs`) and a token (`sample`).

    `device` is where the logits live: a seeded generator must sit on the same device as the
    probabilities `torch.multinomial` draws from.
    """

    def __init__(self, config: SamplingConfig, device: torch.device | str = "cpu") -> None:
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self._processors = build_logits_processors(config)
        self._generator: torch.Generator | None = None
        if config.seed is not None:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(config.seed)
        logger.debug("sampler %s with processors %s", config, [type(p).__name__ for p in self._processors])

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
        scores = self._scores(logits, history)  # [1, V]
        if self.config.is_greedy:
            one_hot = torch.zeros_like(scores[0])
            one_hot[scores[0].argmax()] = 1.0
            return one_hot
        return torch.softmax(scores, dim=-1)[0]

    def sample(self, logits: torch.Tensor, history: torch.Tensor) -> int:
        """Draw the next token id (the argmax when greedy)."""
        if self.config.is_greedy:
            return int(self._scores(logits, history)[0].argmax())
        probs = self.probs(logits, history)  # [V]
        return int(torch.multinomial(probs, 1, generator=self._generator))
