"""Structured output: a reply held to a JSON schema, or to a call of a given tool, by llguidance.

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"schema": …}}) becomes an llguidance grammar over the model's own tokenizer. Before each token
is drawn, the tokens the grammar cannot take next are masked out of the scores (llguidance's
bitmask, computed from the grammar's state), and the drawn token is
fed to the grammar; once the JSON is complete only an end-of-turn token is allowed. As the token
limit nears, what is open is closed (`ConstrainedSampler`: closing tokens wherever the grammar
allows one), so the reply ends by itself, and parses and validates, before the limit.

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
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
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


# the last tokens of a constrained reply's budget, where it checks whether what is open still fits
CLOSING_WINDOW = 64
CLOSERS = frozenset('"]}')  # what ends a JSON string, array or object
SPACE_MARKS = "ĠĊ▁ \t\n"  # how byte-level and sentencepiece vocabularies spell white space


_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {vocab size: texts}


def token_texts(tokenizer: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_token_texts`, worked out once per tokenizer (a 151k vocabulary takes a tenth of a second)."""
    known = _TEXTS.setdefault(tokenizer, {})
    if vocab_size not in known:
        known[vocab_size] = _token_texts(tokenizer, vocab_size)
    return known[vocab_size]


def _token_texts(tokenizer: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token of the vocabulary: (bool: it only ends JSON strings, arrays and objects — `"`,
    `}`, `"}` …; int: the unescaped quotes it writes, which open or close a string; int: how soon
    it ends what is open — its length in characters, white space aside, a tie going to a token
    that ends an array or object rather than a string's quote, or to a digit rather than a sign)."""
    closing = np.zeros(vocab_size, dtype=bool)
    quotes, preference = np.zeros(vocab_size, dtype=np.int32), np.zeros(vocab_size, dtype=np.int32)
    for text, token in vocabulary(tokenizer).items():
        if 0 <= token < vocab_size:
            bare = text.strip(SPACE_MARKS)
            closing[token] = bool(bare) and set(bare) <= CLOSERS
            quotes[token] = text.count('"') - text.count('\\"')
            preference[token] = 4 * len(bare) + 2 * (closing[token] and '"' not in bare) + bare.isdigit()
    return closing, quotes, preference


class ConstrainedSampler(Sampler):
    """A `Sampler` whose draws follow an llguidance grammar (`request_grammar`), and which closes
    what is open before its token `budget` runs out.

    In the budget's last `CLOSING_WINDOW` tokens it works out, on a copy of the grammar's state,
    the shortest way it knows to an accepted end (`_closing_path`: at each step a token that ends a
    string, array or object where the grammar allows one — an open string's quote first (the reply's
    quotes say whether one is open), then `]` or `}`, and a value about to open becomes an empty
    string — else the longest token the grammar allows, which spells a required key or a forced tag
    soonest). Once that path and the end-of-turn token only just fit, it follows
    the path: the JSON, or the call, ends valid before the limit instead of being cut."""

    def __init__(
        self,
        sampler: Sampler,
        tokenizer: Any,
        vocab_size: int,
        eos: Iterable[int],
        grammar: tuple[str, str],
        budget: int | None = None,
    ):
        import llguidance
        import llguidance.hf
        import llguidance.numpy  # llguidance.torch scripts its kernel with the deprecated torch.jit

        super().__init__(sampler.config, sampler.device, sampler.prompt_tokens)
        self._generator = sampler.generator
        if sampler.logprobs is not None:
            self.keep_logprobs(sampler.logprobs)
        self._guidance = llguidance.numpy
        eos_ids = sorted(eos)
        lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids or None)
        grammar, asked_by = grammar
        error = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
        if error:
            raise InvalidRequestError(f"{asked_by}'s schema cannot be used: {error}")
        self.matcher = llguidance.LLMatcher(lltokenizer, grammar)
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)  # int32 [1, V / 32]
        self._vocab_size, self._eos = vocab_size, eos_ids
        self._left = budget  # tokens still to come; None: no limit to close before
        self._closing: list[int] | None = None  # the path to the end, once it is being followed
        texts = token_texts(tokenizer, vocab_size) if budget is not None else (None, None, None)
        self._closers, self._quotes, self._preference = texts
        self._in_string = False  # whether the reply so far leaves a JSON string open

    def _scores(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        scores = super()._scores(logits, history)  # [1, V] float32
        self._guidance.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        masked = scores.cpu().numpy()  # the same memory on the CPU; a copy of a GPU's row
        self._guidance.apply_token_bitmask_inplace(masked, self._bitmask)  # disallowed: -inf
        return scores if scores.device.type == "cpu" else torch.from_numpy(masked).to(scores.device)

    def sample(self, logits: torch.Tensor, history: torch.Tensor) -> int:
        token = self._closing_token()
        if token is None:
            token = super().sample(logits, history)
        elif self.logprobs is not None:  # a closing token is chosen, not drawn: its row all the same
            self._kept(logits, history)
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        if self._left is not None:
            self._left -= 1
            self._in_string ^= bool(self._quotes[token] % 2)
        return token

    def _closing_token(self) -> int | None:
        """The next token of the path to the end where the budget leaves no more room, else None."""
        if self._left is None or self._left > CLOSING_WINDOW:
            return None
        if self._closing is None:
            if self.matcher.is_accepting():
                return self._eos[0] if self._left <= 1 and self._eos else None
            path = self._closing_path(self._left)
            if len(path) + 1 < self._left:  # the end and its end-of-turn token fit later still
                return None
            self._closing = path
        return self._closing.pop(0) if self._closing else (self._eos[0] if self._eos else None)

    def _closing_path(self, limit: int) -> list[int]:
        """The tokens that take a copy of the grammar's state to an accepted end soonest, as far
        as `limit` tokens go."""
        matcher, path, in_string = self.matcher.deep_copy(), [], self._in_string
        while len(path) < limit and not matcher.is_accepting():
            self._guidance.fill_next_token_bitmask(matcher, self._bitmask, 0)
            allowed = np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")[: self._vocab_size]
            allowed = allowed.astype(bool)
            allowed[self._eos] = False
            closers = allowed & self._closers
            # in a string its closing quote (a `]` there is text); outside, `]` or `}` before a new string
            ending = closers & ((self._quotes % 2 == 1) if in_string else (self._quotes == 0))
            pool = ending if ending.any() else closers if closers.any() else allowed
            if not pool.any():
                break
            token = int(np.argmax(np.where(pool, self._preference, -1)))
            if not matcher.consume_token(token):
                break
            path.append(token)
            in_string ^= bool(self._quotes[token] % 2)
        return path
