"""Tool calls in a reply, in the format the model writes them, as OpenAI's `tool_calls`.

Qwen2.5/Qwen3, Hermes and the many models trained on their format call a function by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in their reply (several blocks for parallel calls); their chat templates render `tools` and past
`tool_calls` the same way. `ToolCallStream` follows the streamed answer: text before the first
`<tool_call>` streams on as content, holding back only what could be the start of the tag; from
there on the rest is kept and read at the end. A block that is not a JSON object with a `name`
is no call: then the whole kept text is content, as the model wrote it — but for a last block the
token limit cut off, which is a partial call where its name is whole (`finish_reason: length`).

gpt-oss writes its calls as harmony messages to `functions.NAME`, which the engine reads by their
control tokens and sends apart from the text (`engine_calls`).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


class ToolCallStream:
    """Streamed answer text in, content deltas out; `finish()` gives the rest and the calls."""

    def __init__(self) -> None:
        self._held = ""  # a possible start of the tag, or everything from the first tag on
        self._calling = False

    def feed(self, text: str) -> str:
        """The content `text` completes (held back from the first tag on)."""
        self._held += text
        if self._calling:
            return ""
        at = self._held.find(OPEN)
        if at >= 0:
            content, self._held, self._calling = self._held[:at], self._held[at:], True
            return content
        keep = next((n for n in range(len(OPEN) - 1, 0, -1) if self._held.endswith(OPEN[:n])), 0)
        content, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return content

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(the content still held, the calls): no calls when the kept text does not parse."""
        held, self._held = self._held, ""
        if not self._calling:
            return held, []
        calls = parse_calls(held)
        if calls is None:  # no call: as the model wrote it, but a lone call cut before its name ended
            return ("" if held.startswith(OPEN) and CLOSE not in held and OPEN not in held[1:] else held), []
        return _BLOCK.sub("", held).strip(), calls


def parse_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI `tool_calls` from the `<tool_call>` blocks of `text`; None if a block is no call. A
    last block the reply's token limit cut off (no `</tool_call>`) is a partial call where its
    name was written: its `arguments` the JSON text as far as it got, as OpenAI's own calls cut by
    `length` come back."""
    calls = []
    blocks = list(_BLOCK.finditer(text))
    for n, match in enumerate(blocks):
        block = match.group(1)
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            cut = n == len(blocks) - 1 and not match.group(0).endswith(CLOSE)
            partial = _partial_call(block) if cut else None
            if partial is None:
                return None
            calls.append(partial)
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(openai_call(call["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


_NAME = re.compile(r'^\s*\{\s*"name"\s*:\s*"([^"\\]+)"', re.DOTALL)
_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*', re.DOTALL)


def _partial_call(block: str) -> dict[str, Any] | None:
    """The call a cut-off block began: its whole name, and its arguments' JSON text so far."""
    name = _NAME.match(block)
    if name is None:  # the name itself was cut
        return None
    arguments = _ARGUMENTS.match(block, name.end())
    return openai_call(name.group(1), block[arguments.end() :].rstrip() if arguments else "")


def openai_call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI tool call, with an id of its own; `arguments` is JSON text."""
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def engine_calls(tool_calls: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The calls the engine read from a model's own call messages (gpt-oss's harmony messages to
    `functions.NAME`), in a chat message's form, as OpenAI tool calls: arguments as JSON text."""
    calls = []
    for call in tool_calls:
        arguments = call["function"]["arguments"]
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(openai_call(call["function"]["name"], text))
    return calls


def split_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole answer's content and calls."""
    stream = ToolCallStream()
    content = stream.feed(text)
    rest, calls = stream.finish()
    return content + rest, calls


def template_calls(tool_calls: list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """An assistant message's `tool_calls` as chat templates read them: arguments as an object
    (OpenAI sends a JSON string; templates write `arguments | tojson`)."""
    calls = []
    for call in tool_calls:
        function = dict(call["function"])
        with contextlib.suppress(TypeError, json.JSONDecodeError):  # not JSON: the string as it came
            function["arguments"] = json.loads(function.get("arguments") or "{}")
        calls.append({**call, "function": function})
    return tuple(calls)
