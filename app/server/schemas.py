"""OpenAI's chat-completions and completions requests, as pydantic models, and its errors as
OpenAI shapes them.

`ChatCompletionRequest.parse(body)` (and `CompletionRequest.parse`) checks a decoded JSON body: types are
strict (a bool is not a number, a string is not an integer), ranges are OpenAI's, and
fields OpenAI's clients send that this server does not act on are either harmless
defaults or refused by name. A validation failure becomes one `ApiError` whose `param`
names the field (`messages[0].role`), so a client sees which parameter was wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

MAX_SEED = 2**63 - 1  # the engine's generators take a signed 64-bit seed

# Fields of OpenAI's API the engine does not have: refused unless they ask for nothing.
UNSUPPORTED = (
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
)
HARMLESS = (None, False, 0, [], {}, "none", "auto", {"type": "text"})


class ApiError(Exception):
    """An error response: HTTP status and OpenAI's `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}
        return {"error": error}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class Lenient(BaseModel):
    """Unknown fields are kept and ignored, as OpenAI's API does (clients send `user`, `store` …)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class TextPart(Lenient):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(Lenient):
    name: StrictStr
    arguments: StrictStr  # JSON, as OpenAI sends it


class ToolCall(Lenient):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: StrictStr | None = None  # tool
    # None: an assistant's turn of tool calls only
    content: StrictStr | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, content, info: ValidationInfo):
        if content is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (only an assistant's tool calls may stand without it)")
        return content

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Function(Lenient):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class JsonSchemaFormat(Lenient):
    name: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Tool(Lenient):
    type: Literal["function"]
    function: Function


class NamedFunction(Lenient):
    name: StrictStr = Field(min_length=1)


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Lenient):
    include_usage: StrictBool | None = None


Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an int is a number, a bool is not


MAX_CHOICES = 16  # n: the choices are generated one after another, so each costs a whole reply


class SamplingRequest(Lenient):
    """What chat and text completions share: the model, streaming, the length and the sampling —
    OpenAI's parameters and, as vLLM takes them, `top_k`, `min_p` and `repetition_penalty`."""

    model: StrictStr | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0, le=2)
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stop: StrictStr | list[Annotated[str, Field(min_length=1)]] | None = None
    n: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    # token id (as a string, JSON's keys are) → a bias from -100 (banned) to 100 (forced)
    logit_bias: dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]] | None = None

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; a key that is not a token id is a 400."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise invalid(f"logit_bias keys are token ids (whole numbers), not {key!r}.", "logit_bias")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)

    @classmethod
    def parse(cls, body: object):
        """The request in `body`, or one `ApiError` (400) naming the first wrong field."""
        return validated(cls, body, UNSUPPORTED)


def validated(
    model: type[BaseModel],
    body: object,
    unsupported: tuple[str, ...] = (),
    error: Callable[[ValidationError], ApiError] | None = None,
) -> Any:
    """`body` as `model`, or one `ApiError` (400): a body that is not an object, an `unsupported`
    field that asks for something, or the first validation `error` (by default `first_error`)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    for name in unsupported:
        if body.get(name) not in HARMLESS:
            raise invalid(f"{name} is not supported by this server.", name)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise (error or first_error)(err) from None


class ChatCompletionRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # passed to the chat template, as vLLM and SGLang take them: {"enable_thinking": false} …
    chat_template_kwargs: dict[str, StrictBool | StrictInt | StrictFloat | StrictStr | None] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    tools: list[Tool] | None = None
    # the model decides (auto), calls nothing (none), or must call one of the tools (required) or
    # the named one: a forced call is held to the function's parameters by constrained decoding
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None

    def logprob_alternatives(self) -> int | None:
        """How many alternatives a token's logprobs list (None: no logprobs asked for)."""
        if self.top_logprobs is not None and self.logprobs is not True:
            raise invalid("top_logprobs needs logprobs: true.", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    """OpenAI's legacy `/v1/completions`: a prompt continued as written (text, a list of texts,
    token ids or lists of them), `suffix` to fill in the middle, `echo`, and `logprobs` (how many
    alternatives each token lists: 0 to 20, as vLLM allows)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    suffix: StrictStr | None = None
    echo: StrictBool | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_CHOICES)


def first_error(err: ValidationError) -> ApiError:
    detail = err.errors(include_url=False)[0]
    param = param_name(detail["loc"])
    if param.startswith("logit_bias"):
        return invalid("logit_bias maps token ids to numbers from -100 to 100.", "logit_bias")
    if param == "n":
        return invalid(f"n must be a whole number from 1 to {MAX_CHOICES}.", "n")
    if param.startswith("prompt"):
        return invalid(
            "prompt must be a string, a list of strings, token ids or lists of token ids.", "prompt"
        )
    if param == "stop" or param.startswith("stop["):
        return invalid("stop must be a non-empty string or an array of them.", "stop")
    if param.startswith("messages[") and ".content" in param:
        where = param[: param.index(".content")] + ".content"
        return invalid(
            f"{where} must be a string or a list of text parts (the model reads text only).", where
        )
    if param.startswith("messages[") and param.endswith(".role"):
        return invalid(
            f"{param} {detail.get('input')!r} is not supported: use system, developer, user, assistant "
            "or tool.",
            param,
        )
    if param.startswith("tool_choice"):
        return invalid(
            "tool_choice must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": …}}.',
            "tool_choice",
        )
    return invalid(f"{param}: {detail['msg']}.", param or None)


def param_name(loc: tuple) -> str:
    """`("messages", 0, "content", "str")` → `messages[0].content` (the union's branch dropped)."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in ("str", "list[TextPart]", "function-after[...]", "constrained-str") or "[" in str(part):
            break
        else:
            param += f".{part}" if param else str(part)
    return param
