"""Ollama's `/api/chat` and `/api/generate` requests, as pydantic models, and the OpenAI bodies
they become: a chat-completions body, or for a raw prompt or one with a `suffix` a legacy
completions body, which the same backend answers as it answers OpenAI's clients.

Types are strict, as in `app.server.schemas` (a bool is not a number), and a wrong field is a 400
naming it (`options.temperature`); the sampling options take chat's own checks, under Ollama's
names. Unknown fields and options (`keep_alive`, `num_ctx`, `mirostat` …) are kept and ignored, as
Ollama ignores options a model does not have. What cannot be honoured is refused by name: images,
a custom `template`, a previous reply's `context`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, create_model

from app.server.schemas import ApiError, Lenient, SamplingRequest, invalid, validated

# Ollama's option → the chat field that takes it, with that field's type and range
OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
}
Options = create_model(
    "Options",
    __base__=Lenient,
    num_predict=(StrictInt | None, None),  # -1: no limit of the request's own (-2: fill the context)
    seed=(StrictInt | None, None),  # -1: a random seed, as Ollama takes it
    **{
        name: (SamplingRequest.model_fields[chat].annotation, SamplingRequest.model_fields[chat])
        for name, chat in OPTION_FIELDS.items()
    },
)

# Ollama's words for a model it does not have: to generate with, and to show
NOT_FOUND = 'model "{}" not found, try pulling it first'
NOT_FOUND_TO_SHOW = "model '{}' not found"

Format = Literal["", "json"] | dict[str, Any] | None  # JSON mode, or a JSON schema
Think = StrictBool | Literal["low", "medium", "high"] | None


class FunctionCall(Lenient):
    name: StrictStr
    arguments: dict[str, Any] | StrictStr = Field(default_factory=dict)  # Ollama sends an object


class ToolCall(Lenient):
    function: FunctionCall


class Message(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | None = None
    images: list[StrictStr] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: StrictStr | None = None  # tool: the function whose result this is


class GenerationRequest(Lenient):
    """What `/api/chat` and `/api/generate` share."""

    model: StrictStr
    stream: StrictBool | None = None
    format: Format = None
    options: Options | None = None
    think: Think = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    @property
    def streamed(self) -> bool:
        """Ollama streams unless told not to."""
        return self.stream is not False


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(default_factory=list)  # none: Ollama's "load the model" call
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(GenerationRequest):
    prompt: StrictStr | None = None
    suffix: StrictStr | None = None
    system: StrictStr | None = None
    template: StrictStr | None = None
    raw: StrictBool | None = None
    images: list[StrictStr] | None = None
    context: list[StrictInt] | None = None

    @property
    def continues_text(self) -> bool:
        """Whether the prompt is continued as written (raw, or filled in before a suffix)."""
        return bool(self.raw or self.suffix)


class ShowRequest(Lenient):
    model: StrictStr


def parse(model: type[BaseModel], body: object) -> Any:
    """`body` as `model`, or one `ApiError` (400) naming the first wrong field."""
    return validated(model, body)


def check_model(asked: str, model_id: str, message: str = NOT_FOUND) -> None:
    """A 404 with Ollama's `message` unless `asked` is the served model (with or without the
    `:latest` tag Ollama's clients add to a name without one)."""
    if asked not in (model_id, f"{model_id}:latest"):
        raise ApiError(404, message.format(asked))


def chat_body(request: ChatRequest, model_id: str) -> dict[str, Any]:
    """The chat-completions body for an `/api/chat` request."""
    body = {"model": model_id, "messages": chat_messages(request.messages), **_generation(request)}
    if request.tools:
        body["tools"] = request.tools
    return body


def generate_chat_body(request: GenerateRequest, model_id: str) -> dict[str, Any]:
    """The chat-completions body for an `/api/generate` prompt: the system message and the prompt
    through the model's chat template."""
    _check_generate(request)
    system = [{"role": "system", "content": request.system}] if request.system else []
    messages = [*system, {"role": "user", "content": request.prompt or ""}]
    return {"model": model_id, "messages": messages, **_generation(request)}


def completion_body(request: GenerateRequest, model_id: str, max_tokens: int | None) -> dict[str, Any]:
    """The legacy completions body for a raw `/api/generate` prompt or one with a suffix;
    `max_tokens`: the length when the request sets none (that API's own default is 16 tokens)."""
    _check_generate(request)
    for name in ("format", "logprobs"):
        if getattr(request, name):
            raise invalid(f"{name} is not supported with raw or suffix; leave it out.", name)
    body = {"model": model_id, "prompt": request.prompt or "", **_sampling(request.options)}
    if request.suffix:
        body["suffix"] = request.suffix
    if "max_tokens" not in body and max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def _check_generate(request: GenerateRequest) -> None:
    if request.template:
        raise invalid("template: custom templates are not supported; the model's own is used.", "template")
    if request.images:
        raise invalid("images are not supported: the model reads text only.", "images")
    if request.context:
        raise invalid("context is not supported; send the whole prompt.", "context")


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Ollama's messages as chat's. Ollama's calls have no ids: each gets one, and a tool message
    answers the first unanswered call of its `tool_name` (or the first unanswered one)."""
    chat, unanswered = [], []  # (id, name) of the last assistant message's calls
    for n, message in enumerate(messages):
        if message.images:
            raise invalid("images are not supported: the model reads text only.", f"messages[{n}].images")
        entry: dict[str, Any] = {"role": message.role, "content": message.content or ""}
        if message.tool_calls:
            entry["tool_calls"] = [
                _chat_call(f"call_{n}_{i}", c.function) for i, c in enumerate(message.tool_calls)
            ]
            unanswered = [(call["id"], call["function"]["name"]) for call in entry["tool_calls"]]
        if message.role == "tool" and unanswered:
            answered = next((c for c in unanswered if c[1] == message.tool_name), unanswered[0])
            unanswered.remove(answered)
            entry["tool_call_id"] = answered[0]
        chat.append(entry)
    return chat


def _chat_call(call_id: str, function: FunctionCall) -> dict[str, Any]:
    arguments = function.arguments
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": function.name, "arguments": text}}


def _generation(request: GenerationRequest) -> dict[str, Any]:
    """The chat fields of the options, the format, thinking and logprobs."""
    body = _sampling(request.options)
    if request.format == "json":
        body["response_format"] = {"type": "json_object"}
    elif request.format:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": request.format},
        }
    if isinstance(request.think, bool):  # chat templates with a thinking switch read enable_thinking
        body["chat_template_kwargs"] = {"enable_thinking": request.think}
    elif request.think is not None:
        body["reasoning_effort"] = request.think
    if request.logprobs:
        body["logprobs"] = True
        if request.top_logprobs is not None:
            body["top_logprobs"] = request.top_logprobs
    return body


def _sampling(options: BaseModel | None) -> dict[str, Any]:
    """The sampling options under chat's names; what Ollama means by "none" is left out."""
    if options is None:
        return {}
    chosen = options.model_dump(include=set(OPTION_FIELDS), exclude_none=True)
    body = {OPTION_FIELDS[name]: value for name, value in chosen.items() if value != []}
    if options.seed is not None and options.seed >= 0:
        body["seed"] = options.seed
    if options.num_predict is not None and options.num_predict > 0:  # else the server's own limit
        body["max_tokens"] = options.num_predict
    return body
