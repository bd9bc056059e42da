"""Structured output: a reply held to a JSON schema, or to any JSON object, by llguidance.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"schema": …}}) becomes an llguidance grammar over the model's own tokenizer. Before each token
is drawn, the tokens the grammar cannot take next are masked out of the scores (llguidance's
bitmask, computed from the grammar's state in well under a millisecond), and the drawn token is
fed to the grammar; once the JSON is complete only an end-of-turn token is allowed. The reply
therefore always parses and validates.

Constrained replies decode plainly: a speculative step would have to roll the grammar back
for rejected drafts, which this does not do yet (the request is refused, not silently changed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.sampling import Sampler


def json_schema_of(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The schema a reply must follow; None when it is free text."""
    if response_format is None or response_format.get("type") == "text":
        return None
    if response_format["type"] == "json_object":
        return {"type": "object"}
    return response_format["json_schema"]["schema"]


class ConstrainedSampler(Sampler):
    """A `Sampler` whose draws follow a JSON schema."""

    def __init__(self, sampler: Sampler, tokenizer: Any, vocab_size: int, eos: Iterable[int], schema: dict):
        import llguidance
        import llguidance.hf
        import llguidance.numpy  # llguidance.torch scripts its kernel with the deprecated torch.jit

        super().__init__(sampler.config, sampler.device)
        self._generator = sampler.generator
        self._guidance = llguidance.numpy
        eos_ids = sorted(eos)
        lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids or None)
        # compact separators, no free whitespace: a small model would otherwise pad with newlines
        # until its token limit (xgrammar's and vLLM's default too); a schema may say otherwise
        compact = {"whitespace_flexible": False, **schema.get("x-guidance", {})}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({**schema, "x-guidance": compact}))
        error = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
        if error:
            raise InvalidRequestError(f"response_format's schema cannot be used: {error}")
        self.matcher = llguidance.LLMatcher(lltokenizer, grammar)
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)  # int32 [1, V / 32]

    def _scores(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        scores = super()._scores(logits, history)  # [1, V] float32
        self._guidance.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        masked = scores.cpu().numpy()  # the same memory on the CPU; a copy of a GPU's row
        self._guidance.apply_token_bitmask_inplace(masked, self._bitmask)  # disallowed: -inf
        return scores if scores.device.type == "cpu" else torch.from_numpy(masked).to(scores.device)

    def sample(self, logits: torch.Tensor, history: torch.Tensor) -> int:
        token = super().sample(logits, history)
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        return token
