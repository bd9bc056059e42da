"""Structured output: a reply held to a JSON schema, or to a call of a given tool, by llguidance.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"schema": …}}) becomes an llguidance grammar over the model's own tokenizer. Before each token
is drawn, the tokens the grammar cannot take next are masked out of the scores (llguidance's
bitmask, computed from the grammar's state), and the drawn token is
fed to the grammar; once the JSON is complete only an end-of-turn token is allowed. The reply
therefore always parses and validates.

A forced `tool_choice` ("required", or a named function) is a grammar too: one call, written in
the model's own call format, of one of the functions, its arguments held to the function's
`parameters` schema — Hermes/Qwen's `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`, or
for a harmony model (gpt-oss) a commentary message to `functions.NAME` ended by `<|call|>`. A
prompt that left a `<think>` block open has it closed first: the call is the answer, not a thought.

llguidance rather than xgrammar (`python -m engine.bench.constrained` compares them): a token's
mask costs both a small share of a token, but llguidance compiles a schema far faster, a cost
every request with a new schema pays.

Constrained replies decode plainly: a speculative step would have to roll the grammar back
for rejected drafts, which this does not do yet (the request is refused, not silently changed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from engine.errors import InvalidRequestError
from engine.generation_config import GenerationConfig, forced_tool_names
from engine.sampling import Sampler
from engine.text.reasoning import CLOSE as THINK_CLOSE
from engine.text.reasoning import HARMONY, harmony_splitter_for, splitter_for, vocabulary

# OpenAI: "omitting parameters defines a function with an empty parameter list"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# compact separators, no free whitespace: a small model would otherwise pad with newlines until its
# token limit (xgrammar's and vLLM's default too); a schema's own x-guidance may say otherwise
COMPACT = {"whitespace_flexible": False}
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # Hermes/Qwen's, as app.server.tool_calls reads them


def json_schema_of(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The schema a reply must follow; None when it is free text."""
    if response_format is None or response_format.get("type") == "text":
        return None
    if response_format["type"] == "json_object":
        return {"type": "object"}
    return response_format["json_schema"]["schema"]


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": {**COMPACT, **schema.get("x-guidance", {})}}


def request_grammar(
    config: GenerationConfig, tokenizer: Any, prompt_ids: list[int]
) -> tuple[str, str] | None:
    """The llguidance grammar a request's reply must follow, and what asked for it (for errors);
    None for free text."""
    import llguidance

    schema = json_schema_of(config.response_format)
    forced = forced_tool_names(config.tool_choice, config.tools)
    if schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_compact(schema))), "response_format"
    if not forced:
        return None
    parameters = {t["function"]["name"]: t["function"].get("parameters") for t in config.tools}
    calls = {name: parameters[name] or NO_PARAMETERS for name in forced}
    if harmony_splitter_for(tokenizer) is not None:
        lark = harmony_call_lark(calls, "<|constrain|>" in vocabulary(tokenizer))
    else:
        thinking = splitter_for(tokenizer, prompt_ids)
        lark = hermes_call_lark(
            calls, vocabulary(tokenizer), close_think=thinking is not None and thinking.inside
        )
    return llguidance.LLMatcher.grammar_from_lark(lark), "tool_choice"


def hermes_call_lark(calls: dict[str, dict], vocab: Mapping[str, int], close_think: bool = False) -> str:
    """One `<tool_call>` block calling one of `calls` (name -> parameters schema)."""
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, parameters in calls.items()
        ]
    }
    opening = f"{_tag(THINK_CLOSE, vocab)} " + '"\\n\\n" ' if close_think else ""
    call = json.dumps(_compact(schema))
    start = f'start: {opening}{_tag(CALL_OPEN, vocab)} "\\n" call "\\n" {_tag(CALL_CLOSE, vocab)}'
    return f"{start}\ncall: %json {call}\n"


def _tag(tag: str, vocab: Mapping[str, int]) -> str:
    """A tag in a lark grammar: the token of its own a vocabulary gives it (Qwen's `<tool_call>`,
    `</think>`: added tokens, which the model writes as one token and llguidance reads as special),
    else its text."""
    return f"<[{vocab[tag]}]>" if tag in vocab else json.dumps(tag)


def harmony_call_lark(calls: dict[str, dict], constrain: bool = True) -> str:
    """One harmony commentary message to `functions.NAME`, one of `calls`, ended by `<|call|>`."""
    channel, message, call = HARMONY[1], HARMONY[2], HARMONY[5]
    content_type = f'{HARMONY[6]} "json"' if constrain else '"json"'  # gpt-oss writes <|constrain|>json
    rules = [f"start: {' | '.join(f'call_{n}' for n in range(len(calls)))}"]
    for n, (name, parameters) in enumerate(calls.items()):
        header = json.dumps(f"commentary to=functions.{name} ")
        rules.append(f"call_{n}: {channel} {header} {content_type} {message} args_{n} {call}")
        rules.append(f"args_{n}: %json {json.dumps(_compact(parameters))}")
    return "\n".join(rules) + "\n"


class ConstrainedSampler(Sampler):
    """A `Sampler` whose draws follow an llguidance grammar (`request_grammar`)."""

    def __init__(
        self, sampler: Sampler, tokenizer: Any, vocab_size: int, eos: Iterable[int], grammar: tuple[str, str]
    ):
        import llguidance
        import llguidance.hf
        import llguidance.numpy  # llguidance.torch scripts its kernel with the deprecated torch.jit

        super().__init__(sampler.config, sampler.device)
        self._generator = sampler.generator
        self._guidance = llguidance.numpy
        eos_ids = sorted(eos)
        lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids or None)
        grammar, asked_by = grammar
        error = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
        if error:
            raise InvalidRequestError(f"{asked_by}'s schema cannot be used: {error}")
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
