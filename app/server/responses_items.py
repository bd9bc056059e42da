"""The Responses API's answer made of a chat completion's: a `response` object with its output items
(a `reasoning` item for the model's reasoning, a `message` item for its text, a `function_call`
item a call), and, for a streamed reply, the chat chunks turned into the Responses events in
OpenAI's order, each with its `sequence_number`.

It knows nothing of requests: what a response says of its request (instructions, tools, sampling
…) comes in as one `echo` dict from `app.server.responses_api`.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

from app.server.schemas import ApiError

# a text item's kind → its id's prefix, the stem of its streamed events' names, and what its
# delta and done events carry besides the text (a message's tokens' logprobs: none here)
TEXT_KINDS = {
    "message": ("msg", "response.output_text", {"logprobs": []}),
    "reasoning": ("rs", "response.reasoning_text", {}),
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def text_item(kind: str, item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """A `message` or `reasoning` output item; `text` None: just opened, no content part yet."""
    content = [] if text is None else [text_part(kind, text)]
    if kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: dict, arguments: str, status: str) -> dict[str, Any]:
    """A `function_call` output item for one of the chat reply's `tool_calls`."""
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict, finish_reason: str) -> list[dict[str, Any]]:
    """A whole chat message's output items: its reasoning, its text, its calls; a text the token
    limit cut (the last item, calls aside) is `incomplete`."""
    items = []
    if message.get("reasoning_content"):
        items.append(text_item("reasoning", new_id("rs"), message["reasoning_content"], "completed"))
    if message.get("content"):
        items.append(text_item("message", new_id("msg"), message["content"], "completed"))
    calls = message.get("tool_calls") or []
    if items and not calls and finish_reason == "length":
        items[-1]["status"] = "incomplete"
    items += [call_item(new_id("fc"), call, call["function"]["arguments"], "completed") for call in calls]
    return items


def response_usage(usage: dict) -> dict[str, Any]:
    """Chat's `usage` in the Responses API's names."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        # cache writes are not counted apart: the engine reports only what its kept cache held
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def response_head(chat: dict) -> dict[str, Any]:
    """A response's id, time and model, from its chat completion (or its first chunk)."""
    return {"id": new_id("resp"), "created_at": chat["created"], "model": chat["model"]}


def response(
    head: dict,
    echo: dict,
    output: list[dict] | None = None,
    finish_reason: str | None = None,
    usage: dict | None = None,
    stats: dict | None = None,
) -> dict[str, Any]:
    """The `response` object; without a finish reason it is still in progress. A reply the token
    limit cut is `incomplete`; MoE Chat's `stats` stand beside `usage`."""
    status, incomplete = "completed", None
    if finish_reason is None:
        status = "in_progress"
    elif finish_reason == "length":
        status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    body = {
        "id": head["id"],
        "object": "response",
        "created_at": head["created_at"],
        "status": status,
        "model": head["model"],
        "output": list(output or ()),
        "usage": response_usage(usage) if usage else None,
        **echo,
        "error": None,
        "incomplete_details": incomplete,
    }
    if stats is not None:
        body["stats"] = stats
    return body


def whole_response(chat: dict, echo: dict) -> dict[str, Any]:
    """The `response` object for a whole chat completion."""
    choice = chat["choices"][0]
    output = output_items(choice["message"], choice["finish_reason"])
    return response(
        response_head(chat), echo, output, choice["finish_reason"], chat["usage"], chat.get("stats")
    )


class ResponseStream:
    """A streamed reply's chat chunks in, the Responses events out. Text and reasoning open an item
    at their first delta and close it when something else begins or the reply ends; a call, which
    chat sends whole, is an item of its own with its arguments as one delta."""

    def __init__(self, echo: dict):
        self.echo = echo
        self.head: dict[str, Any] = {}
        self.sequence = 0
        self.output: list[dict] = []  # the items done
        self.open: dict[str, str] | None = None  # the text item under way: kind, id, text

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return event

    def error(self, err: ApiError) -> dict[str, Any]:
        """The `error` event for an error once the stream has begun."""
        return self.event("error", code=err.code, message=err.message, param=err.param)

    def events(self, chunks: Iterator[dict]) -> Iterator[dict[str, Any]]:
        """The events of the reply `chunks` make; nothing before the first chunk, so an error
        until then keeps its own HTTP status."""
        first = next(chunks)
        self.head = response_head(first)
        yield self.event("response.created", response=response(self.head, self.echo))
        yield self.event("response.in_progress", response=response(self.head, self.echo))
        finish, usage, stats = "stop", None, None
        for chunk in itertools.chain([first], chunks):
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                yield from self._delta(choice["delta"])
                if choice["finish_reason"] is not None:
                    finish, stats = choice["finish_reason"], chunk.get("stats")
                    yield from self._close("incomplete" if finish == "length" else "completed")
        final = response(self.head, self.echo, self.output, finish, usage, stats)
        yield self.event(f"response.{final['status']}", response=final)

    def _delta(self, delta: dict) -> Iterator[dict[str, Any]]:
        if delta.get("reasoning_content"):
            yield from self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            yield from self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            yield from self._call(call)

    def _text(self, kind: str, delta: str) -> Iterator[dict[str, Any]]:
        if self.open is None or self.open["kind"] != kind:
            yield from self._close("completed")
            yield from self._open(kind)
        self.open["text"] += delta
        _, stem, extra = TEXT_KINDS[kind]
        yield self.event(f"{stem}.delta", **self._where(), delta=delta, **extra)

    def _open(self, kind: str) -> Iterator[dict[str, Any]]:
        self.open = {"kind": kind, "id": new_id(TEXT_KINDS[kind][0]), "text": ""}
        item = text_item(kind, self.open["id"], None, "in_progress")
        yield self.event("response.output_item.added", output_index=len(self.output), item=item)
        yield self.event("response.content_part.added", **self._where(), part=text_part(kind, ""))

    def _close(self, status: str) -> Iterator[dict[str, Any]]:
        """The text item under way, done."""
        if self.open is None:
            return
        kind, text = self.open["kind"], self.open["text"]
        _, stem, extra = TEXT_KINDS[kind]
        yield self.event(f"{stem}.done", **self._where(), text=text, **extra)
        yield self.event("response.content_part.done", **self._where(), part=text_part(kind, text))
        yield from self._done(text_item(kind, self.open["id"], text, status))
        self.open = None

    def _where(self) -> dict[str, Any]:
        """Where the text item under way stands: its id, its place in the output, its one part."""
        return {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}

    def _call(self, call: dict) -> Iterator[dict[str, Any]]:
        yield from self._close("completed")
        item_id, arguments = new_id("fc"), call["function"]["arguments"]
        item = call_item(item_id, call, "", "in_progress")
        yield self.event("response.output_item.added", output_index=len(self.output), item=item)
        where = {"item_id": item_id, "output_index": len(self.output)}
        yield self.event("response.function_call_arguments.delta", **where, delta=arguments)
        yield self.event("response.function_call_arguments.done", **where, arguments=arguments)
        yield from self._done(call_item(item_id, call, arguments, "completed"))

    def _done(self, item: dict) -> Iterator[dict[str, Any]]:
        yield self.event("response.output_item.done", output_index=len(self.output), item=item)
        self.output.append(item)
