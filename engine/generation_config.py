"""What a generation request asks for: sampling, speculation, prefetch and limits.

Frozen, validated dataclasses and the names of the choices they allow, and what a reply carries
besides its text (`TokenLogprob`, `PromptEcho`). This module imports neither torch nor
transformers, so the worker protocol (and the GUI through it) can carry these as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

SPEC_MODES = ("none", "draft", "self", "substitute", "mtp")
ACCEPTANCE_RULES = ("lossless", "adaptive")
PREFETCH_POLICIES = ("none", "next-layer", "hybrimoe", "spmoe")
# "auto": the best setting for the model and machine, chosen when the decoder opens
# (engine.speculative.auto): what every front-end asks for when the user chose nothing.
AUTO = "auto"
SPEC_CHOICES = (AUTO, *SPEC_MODES)
PREFETCH_CHOICES = (AUTO, *PREFETCH_POLICIES)
CPU_EXPERT_MODES = ("auto", "never", "always")
TemplateValue = bool | int | float | str | None
# keyword arguments the templating itself takes: a request may not set them
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tokenize", "conversation", "tools")
# Seeds are signed 64-bit on every side (torch's generators, JSON clients): 0 <= seed < SEED_LIMIT
SEED_LIMIT = 2**63
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # and for a logit_bias value: [-100, 100]
MAX_TOP_LOGPROBS = 20  # and for top_logprobs


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen; the defaults match a typical chat setting."""

    temperature: float = 0.7  # 0 (or greedy=True) means greedy decoding
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1.0 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drops tokens below min_p × the likeliest's probability; 0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; > 1 discourages tokens already in the history
    seed: int | None = None  # None = torch's global generator
    greedy: bool = False
    # OpenAI's penalties, over the reply's tokens so far: a token's logit loses
    # frequency_penalty × its count + presence_penalty once it has appeared (0 = off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: (token id, bias added to its logit) pairs; -100 bans a token, 100 forces it
    logit_bias: tuple[tuple[int, float], ...] = ()

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
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 turns it off), got {self.min_p!r}")
        if not _is_real(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise InvalidRequestError(
                f"repetition_penalty must be a number > 0 (1 turns it off), got {self.repetition_penalty!r}"
            )
        _check_openai_sampling(self)
        if self.seed is not None and not _is_whole(self.seed, 0, SEED_LIMIT):
            raise InvalidRequestError(
                f"seed must be an integer from 0 to 2**63 - 1 ({SEED_LIMIT - 1}), or unset for a new "
                f"draw each time; got {self.seed!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

    @property
    def penalizes(self) -> bool:
        """Whether OpenAI's presence or frequency penalty is on (they read the reply's tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def _check_openai_sampling(config: SamplingConfig) -> None:
    """OpenAI's ranges for its penalties and logit_bias."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(config, name)
        if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise InvalidRequestError(f"{name} must be a number from -2 to 2 (0 turns it off), got {value!r}")
    for token, bias in config.logit_bias:
        if not _is_whole(token, 0) or not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias maps token ids (integers >= 0) to biases in [-100, 100], not {token!r}: {bias!r}"
            )


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_whole(value: object, low: int, high: int | None = None) -> bool:
    """An int (not a bool) with low <= value (< high when given)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return low <= value and (high is None or value < high)


def is_unicode(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (a lone surrogate such as "\\ud800" cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def derived_seed(seed: int | None, offset: int) -> int | None:
    """A second generator's seed, apart from `seed` and still in [0, SEED_LIMIT) (None stays None)."""
    return None if seed is None else (seed + offset) % SEED_LIMIT


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings (mode 'none' decodes one token per target forward)."""

    mode: str = "none"  # auto | none | draft | self | substitute | mtp (the checkpoint's MTP layer)
    draft_model: str | None = None  # folder of the draft model (mode 'draft')
    draft_len: int = 4  # γ: draft tokens per verify step (the start value when adapting)
    adapt_draft_len: bool = True  # adapt γ online from the acceptance seen
    max_draft_len: int = 16
    top_r: int = 1  # self: experts per token while drafting (r < k)
    cached_only: bool = False  # self: draft only from experts already cached (zero I/O)
    substitute_bits: int = 4  # substitute: bits of the resident expert copies
    # stop drafting after a token whose draft probability (the max) is below tau (0: off): the
    # demo draft's tokens below 0.3 were accepted far less often than those above it
    confidence_tau: float = 0.3
    acceptance: str = "lossless"  # lossless | adaptive (SS-MoE; NOT lossless)
    adaptive_tau: float = 0.5
    adaptive_tolerance: float = 0.1

    def validate(self) -> None:
        if self.mode not in SPEC_CHOICES:
            raise InvalidRequestError(
                f"Unknown --spec {self.mode!r}; choose one of {', '.join(SPEC_CHOICES)}."
            )
        if self.mode == "draft" and not self.draft_model:
            raise InvalidRequestError(
                "--spec draft needs --draft-model DIR (a small model with the same tokenizer)."
            )
        if not 1 <= self.draft_len <= self.max_draft_len:
            raise InvalidRequestError(
                f"--draft-len must be between 1 and {self.max_draft_len}, got {self.draft_len}."
            )
        if self.top_r < 1:
            raise InvalidRequestError(f"--top-r must be at least 1, got {self.top_r}.")
        if self.substitute_bits not in (4, 8):
            raise InvalidRequestError(f"Substitute experts are int4 or int8, not {self.substitute_bits}-bit.")
        if not 0 <= self.confidence_tau < 1:
            raise InvalidRequestError(
                f"The confidence threshold must be in [0, 1), got {self.confidence_tau}."
            )
        if self.acceptance not in ACCEPTANCE_RULES:
            raise InvalidRequestError(
                f"Unknown acceptance rule {self.acceptance!r}; choose one of {', '.join(ACCEPTANCE_RULES)}."
            )

    @property
    def lossless(self) -> bool:
        return self.acceptance == "lossless"


@dataclass(frozen=True)
class CompletionPrompt:
    """A prompt continued as written, with no chat template (OpenAI's `/v1/completions`, Ollama's
    raw generate): `text`, or `token_ids` when there is no text. `suffix` asks the model to fill in
    between the text and it, in its fill-in-the-middle format; `echo` sends the prompt back before
    the reply (with its tokens' log-probabilities when the request asks for logprobs)."""

    text: str | None = None
    token_ids: tuple[int, ...] = ()
    suffix: str | None = None
    echo: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """A token as text, its log-probability and the likeliest alternatives' (the distribution it
    was drawn from, after the sampling's processors)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class PromptEcho:
    """A completion prompt sent back before its reply: its text (token ids spelled out), its tokens
    spelled one by one, and when the request asks for logprobs each prompt token's (None for the
    first: nothing came before it)."""

    text: str
    tokens: tuple[str, ...]
    logprobs: tuple[TokenLogprob | None, ...] = ()


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    prefill_chunk: int = 512
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens
    spec: SpecConfig = field(default_factory=SpecConfig)
    prefetch: str = "none"  # auto | none | next-layer | hybrimoe | spmoe
    cutoff: int | None = None  # spmoe: last MoE layer (0-based, in order) prefetched; None: auto
    cpu_experts: str = "never"  # auto | never | always: compute missing experts on the CPU (hybrid)
    # a context window (prompt + reply, in tokens) below the model's; None: the model's own
    context_length: int | None = None
    # passed to the chat template: {"enable_thinking": False}, {"reasoning_effort": "low"} …
    template_kwargs: dict[str, TemplateValue] = field(default_factory=dict, hash=False)
    # functions the model may call, as OpenAI's `tools` ({"type": "function", "function": {…}}):
    # the chat template writes them into the prompt
    tools: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    # OpenAI's tool_choice: "auto" (the model decides), "required" (a call to one of `tools`) or
    # {"type": "function", "function": {"name": …}}; a forced call is held to the function's
    # parameters schema by engine.constraints (plain decoding only)
    tool_choice: str | dict[str, Any] = field(default="auto", hash=False)
    # OpenAI's response_format: {"type": "json_object"} or a json_schema the reply must follow
    # (engine.constraints; plain decoding only)
    response_format: dict[str, Any] | None = field(default=None, hash=False)
    # each generated token's log-probability and this many likeliest alternatives (None: none)
    logprobs: int | None = None

    def template_arguments(self) -> dict[str, Any]:
        """What the chat template is given besides the messages: the request's own arguments and
        the tools."""
        return {**self.template_kwargs, **({"tools": list(self.tools)} if self.tools else {})}

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be at least 1.")
        if self.context_length is not None and not _is_whole(self.context_length, 1):
            raise InvalidRequestError(
                f"context_length must be a whole number of tokens >= 1 (None: the model's own "
                f"window), got {self.context_length!r}"
            )
        if self.logprobs is not None and not _is_whole(self.logprobs, 0, MAX_TOP_LOGPROBS + 1):
            raise InvalidRequestError(
                f"logprobs asks for 0 to {MAX_TOP_LOGPROBS} alternatives a token, not {self.logprobs!r}."
            )
        if self.prefill_chunk < 1:
            raise InvalidRequestError("prefill_chunk must be at least 1.")
        if any(not s for s in self.stop_strings):
            raise InvalidRequestError("Stop strings cannot be empty.")
        if any(not is_unicode(s) for s in self.stop_strings):
            raise InvalidRequestError(
                "A stop string contains text that is not valid Unicode (a lone surrogate): "
                "send it as UTF-8 or remove the broken character."
            )
        if self.prefetch not in PREFETCH_CHOICES:
            raise InvalidRequestError(
                f"Unknown prefetch policy {self.prefetch!r}; choose one of {', '.join(PREFETCH_CHOICES)}."
            )
        if self.cpu_experts not in CPU_EXPERT_MODES:
            raise InvalidRequestError(
                f"Unknown cpu_experts {self.cpu_experts!r}; choose one of {', '.join(CPU_EXPERT_MODES)}."
            )
        _check_template_kwargs(self.template_kwargs)
        _check_tools(self.tools)
        _check_tool_choice(self.tool_choice, self.tools)
        _check_response_format(self.response_format)
        json_reply = (self.response_format or {}).get("type", "text") != "text"
        if json_reply and forced_tool_names(self.tool_choice, self.tools):
            raise InvalidRequestError("A reply cannot be both a forced tool call and response_format's JSON.")
        self.sampling.validate()
        self.spec.validate()


def _check_template_kwargs(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(f"{name!r} cannot be passed to the chat template.")
        if value is not None and not isinstance(value, bool | int | float | str):
            raise InvalidRequestError(
                f"Chat template argument {name!r} must be a string, number, boolean or null."
            )


def _check_tools(tools: tuple) -> None:
    for n, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function" or not function.get("name"):
            raise InvalidRequestError(
                f"Tool {n} must be {{'type': 'function', 'function': {{'name': …, 'parameters': …}}}}."
            )


TOOL_CHOICES = ("auto", "required")


def forced_tool_names(tool_choice: str | dict[str, Any], tools: tuple) -> tuple[str, ...]:
    """The functions a reply must call one of; () when the model decides for itself."""
    if tool_choice == "required":
        return tuple(tool["function"]["name"] for tool in tools)
    if isinstance(tool_choice, dict):
        return (tool_choice["function"]["name"],)
    return ()


def _check_tool_choice(tool_choice: object, tools: tuple) -> None:
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                "tool_choice must be 'auto', 'required' or {'type': 'function', 'function': {'name': …}}."
            )
        if name not in {tool["function"]["name"] for tool in tools}:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not a tool.")
    elif tool_choice not in TOOL_CHOICES:
        raise InvalidRequestError(
            f"tool_choice must be 'auto', 'required' or a named function, not {tool_choice!r}."
        )
    elif tool_choice == "required" and not tools:
        raise InvalidRequestError("tool_choice 'required' needs tools to call.")


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _check_response_format(response_format: dict[str, Any] | None) -> None:
    if response_format is None:
        return
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequestError(
            f"response_format type must be one of {', '.join(RESPONSE_FORMATS)}, not {kind!r}."
        )
    if kind == "json_schema" and not isinstance(
        (response_format.get("json_schema") or {}).get("schema"), dict
    ):
        raise InvalidRequestError(
            "response_format json_schema needs json_schema.schema, a JSON schema object."
        )
