"""OpenAI's Responses API, `POST /v1/responses`, as a translation: the request becomes a
chat-completions body for the same backend (`ChatBackend.complete` / `.stream`), and the chat
reply becomes a `response` object or its stream of events (`app.server.responses_items`).

Understood, as vLLM documents the subset: `model`, `input` (a string, or a list of items: messages
of user, system, developer or assistant with text content, `function_call` items and their
`function_call_output`s; `reasoning` items sent back are taken and not read), `instructions` (a
system message first), `tools` (function tools only), `tool_choice`, `max_output_tokens`,
`temperature`, `top_p`, `stream`, `text.format` (text, json_object, json_schema), `reasoning.effort`,
`metadata`, `parallel_tool_calls`, `store` and `user` (taken; nothing is stored). The server keeps no
responses, so `previous_response_id` is a 400: a client sends the whole conversation as `input`.
Features it does not have (`background`, `include`, `conversation`, `prompt`, `top_logprobs`) are
a 400 naming them. Every error names the Responses parameter, also one the chat backend found.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr, ValidationError

from app.server.http_io import json_body, run_cancellable, sse_response
from app.server.responses_items import ResponseStream, whole_response
from app.server.schemas import ApiError, Lenient, Number, invalid, param_name, validated

UNSUPPORTED = ("background", "include", "conversation", "prompt", "top_logprobs")
NO_STORE = (
    "previous_response_id is not supported: this server keeps no responses; send the whole "
    "conversation as input."
)
# a chat-completions parameter a backend error names → the Responses parameter it came from
CHAT_PARAMS = (
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("reasoning_effort", "reasoning.effort"),
)


class TextPart(Lenient):
    type: Literal["input_text", "output_text"]
    text: StrictStr


Text = StrictStr | list[TextPart]


class InputMessage(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1)
    name: StrictStr = Field(min_length=1)
    arguments: StrictStr  # JSON, as the model wrote it


class FunctionCallOutput(Lenient):
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1)
    output: Text


class ReasoningItem(Lenient):
    """An earlier reply's reasoning, sent back with its output: taken, not shown to the model again."""

    type: Literal["reasoning"]


INPUT_ITEMS: dict[str, type[BaseModel]] = {
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutput,
    "reasoning": ReasoningItem,
}


class FunctionTool(Lenient):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(Lenient):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(Lenient):
    format: TextFormat | None = None


class ReasoningConfig(Lenient):
    effort: Literal["minimal", "low", "medium", "high"] | None = None


class ResponsesRequest(Lenient):
    """A Responses request; its input items are checked one by one (`input_item`), each as the
    model its `type` names, so an error names the item: `input[2].call_id`."""

    model: StrictStr | None = None
    input: StrictStr | Annotated[list[dict[str, Any]], Field(min_length=1)]  # items checked one by one
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    stream: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    store: StrictBool | None = None
    parallel_tool_calls: StrictBool | None = None


def add_routes(app: FastAPI, api) -> None:
    """`POST /v1/responses` on `app`, answered through `api.complete` / `api.stream` (`ChatBackend`)."""

    @app.post("/v1/responses")
    async def responses(request: Request):
        parsed = parse_request(await json_body(request))
        chat, echo = chat_body(parsed), response_echo(parsed)
        if parsed.stream:
            stream = ResponseStream(echo)
            events = _events(api, chat, stream)
            return await sse_response(
                events, done=False, event_name=lambda event: event["type"], error_item=stream.error
            )
        with responses_params():
            reply = await run_cancellable(lambda cancelled: api.complete(chat, cancelled), request)
        return whole_response(reply, echo)


def _events(api, chat: dict, stream: ResponseStream) -> Iterator[dict[str, Any]]:
    """The stream's events; closing them closes the chat chunks, which cancels the generation."""
    with responses_params(), contextlib.closing(api.stream(chat)) as chunks:
        yield from stream.events(chunks)


def parse_request(body: object) -> ResponsesRequest:
    """The request in `body`, or one `ApiError` (400) naming the first wrong Responses parameter."""
    if isinstance(body, dict) and body.get("previous_response_id") is not None:
        raise invalid(NO_STORE, "previous_response_id")
    return validated(ResponsesRequest, body, UNSUPPORTED, _validation_error)


def _validation_error(err: ValidationError, item: str = "") -> ApiError:
    """The first error as a 400 naming its parameter; `item`: the input item that was checked."""
    detail = err.errors(include_url=False)[0]
    param = ".".join(part for part in (item, param_name(detail["loc"])) if part)
    if param == "input":
        return invalid("input must be a string or a non-empty list of items (JSON objects).", param)
    if item and param.endswith((".content", ".output")):
        return invalid(f"{param} must be a string or a list of input_text parts (text only).", param)
    if item and param.endswith(".role"):
        message = (
            f"{param} {detail.get('input')!r} is not supported: use user, system, developer or assistant."
        )
        return invalid(message, param)
    if re.fullmatch(r"tools\[\d+\]\.type", param):
        message = f"{param} {detail.get('input')!r} is not supported: this server calls functions only."
        return invalid(message, param)
    if param.startswith("tool_choice"):
        message = 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": …}.'
        return invalid(message, "tool_choice")
    return invalid(f"{param}: {detail['msg']}.", param or None)


def input_item(index: int, raw: dict[str, Any]) -> BaseModel:
    """Input item `index`, checked as the model its `type` names (a message when it has none)."""
    kind = raw.get("type", "message")
    model = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        known = ", ".join(INPUT_ITEMS)
        raise invalid(f"input[{index}].type {kind!r} is not supported: use {known}.", f"input[{index}].type")
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise _validation_error(err, f"input[{index}]") from None


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: the instructions first, as a system message; function
    calls in a row join the assistant message before them, as one turn's `tool_calls`."""
    messages = [] if request.instructions is None else [{"role": "system", "content": request.instructions}]
    if isinstance(request.input, str):
        return [*messages, {"role": "user", "content": request.input}]
    for index, raw in enumerate(request.input):
        item = input_item(index, raw)
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        elif isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
    return messages


def chat_body(request: ResponsesRequest) -> dict[str, Any]:
    """The chat-completions body asking for the same reply (streamed, with its usage, when asked)."""
    body: dict[str, Any] = {"messages": chat_messages(request)}
    same = {"model": request.model, "temperature": request.temperature, "top_p": request.top_p}
    body |= {name: value for name, value in same.items() if value is not None}
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    if request.tools:
        body["tools"] = [{"type": "function", "function": _function(tool)} for tool in request.tools]
    if isinstance(request.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice.name}}
    elif request.tool_choice is not None:
        body["tool_choice"] = request.tool_choice
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type != "text":
        body["response_format"] = _response_format(text_format)
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["reasoning_effort"] = request.reasoning.effort
    if request.stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _function(tool: FunctionTool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    return {name: value for name, value in function.items() if value is not None}


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    """`text.format` as chat's `response_format`: a JSON schema moves under `json_schema`."""
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise invalid("text.format.schema is required for a json_schema format.", "text.format.schema")
    schema = {name: value for name, value in _dump(text_format).items() if name != "type"}
    return {"type": "json_schema", "json_schema": schema}


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(by_alias=True, exclude_none=True)


def response_echo(request: ResponsesRequest) -> dict[str, Any]:
    """What a response says of the request it answers, as OpenAI's responses do."""
    choice = request.tool_choice
    text_format = request.text.format if request.text is not None else None
    return {
        "instructions": request.instructions,
        "tools": [_dump(tool) for tool in request.tools or ()],
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "text": {"format": _dump(text_format) if text_format is not None else {"type": "text"}},
        "reasoning": request.reasoning.model_dump() if request.reasoning is not None else None,
        "metadata": request.metadata or {},
        "previous_response_id": None,
        "store": False,  # nothing is kept, whatever the request asked
        "background": False,
        "truncation": "disabled",
    }


@contextlib.contextmanager
def responses_params() -> Iterator[None]:
    """An `ApiError` from the chat backend names the Responses parameter, not chat's."""
    try:
        yield
    except ApiError as err:
        err.param = responses_param(err.param)
        raise


def responses_param(param: str | None) -> str | None:
    """The Responses parameter for a chat-completions one: `messages[2].content` is somewhere in
    `input`, `tools[0].function.parameters` is `tools[0].parameters`, …"""
    if param is None or param.startswith("messages"):
        return "input" if param else None
    param = re.sub(r"^(tools\[\d+\])\.function\b", r"\1", param)
    for chat, responses in CHAT_PARAMS:
        if param == chat or param.startswith((chat + ".", chat + "[")):
            return responses + param[len(chat) :]
    return param
