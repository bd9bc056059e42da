"""A reply's reasoning apart from its answer: `<think>…</think>` blocks parsed from the stream.

Qwen3, QwQ, DeepSeek-R1 and GLM-4.5 think inside `<think>…</think>` before they answer. Their
chat templates either let the model open the block itself, or open it in the prompt (Qwen3's
Thinking-2507 releases, DeepSeek-R1), in which case the reply holds only the closing tag; with
`enable_thinking=False` Qwen3's template writes an empty block into the prompt and the reply has
none. `ThinkSplitter` follows the text as it streams and says which part is reasoning and which
is the answer, holding back only what could still be the start of a tag, as vLLM's and SGLang's
reasoning parsers do. The whitespace a model puts between the block and its answer belongs to
neither.

A model whose vocabulary has no `<think>`/`</think>` tokens is not parsed (`splitter_for`), so a
reply that merely mentions the tag is left alone.

gpt-oss writes harmony messages instead: `HarmonySplitter` reads them by their control-token ids,
its analysis channel as reasoning, its final channel as the answer, and a message addressed to
`functions.NAME` as a tool call (`tool_calls()`); `one_call_per_message` lays out a history with
parallel calls the way gpt-oss's chat template can render it.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

OPEN, CLOSE = "<think>", "</think>"


class ThinkSplitter:
    """Streamed text in, `(reasoning, answer)` deltas out."""

    def __init__(self, inside: bool = False):
        self.inside = inside  # in a think block (the prompt may have opened it)
        self.seen_block = inside
        self._pending = ""  # text that may be the start of a tag
        self._started = {True: False, False: False}  # reasoning, answer: has text been given yet

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and answer text `text` completes (either may be "")."""
        text = self._pending + text
        self._pending = ""
        reasoning, answer = [], []
        while text:
            tag = CLOSE if self.inside else (OPEN if not self.seen_block else None)
            at = text.find(tag) if tag else -1
            if at >= 0:
                self._emit(text[:at], reasoning, answer)
                text = text[at + len(tag) :]
                self.inside = not self.inside
                self.seen_block = True
                continue
            keep = _partial_tag(text, tag) if tag else 0
            self._emit(text[: len(text) - keep], reasoning, answer)
            self._pending = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(answer)

    def flush(self) -> tuple[str, str]:
        """The text held back at the end of the reply (an unfinished tag is text after all)."""
        pending, self._pending = self._pending, ""
        reasoning, answer = [], []
        self._emit(pending, reasoning, answer)
        return "".join(reasoning), "".join(answer)

    def _emit(self, text: str, reasoning: list[str], answer: list[str]) -> None:
        """`text` to the part it belongs to; the blank lines that open a block or follow one are dropped."""
        if not self._started[self.inside]:
            text = text.lstrip() if self.inside or self.seen_block else text
            if not text:
                return
            self._started[self.inside] = True
        (reasoning if self.inside else answer).append(text)


def _partial_tag(text: str, tag: str) -> int:
    """How many of `text`'s last characters are a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(tokenizer: Any) -> Mapping[str, int]:
    """The tokenizer's vocabulary, added tokens included: asked of the tokenizer once (a 151k
    vocabulary's `get_vocab()` is slow, and every request looks a few tokens up in it)."""
    if tokenizer is None:
        return {}
    vocab = _VOCABULARIES.get(tokenizer)
    if vocab is None:
        vocab = _VOCABULARIES[tokenizer] = tokenizer.get_vocab()
    return vocab


def thinks(tokenizer: Any) -> bool:
    """Whether the model's vocabulary has the think tags as tokens of their own."""
    vocab = vocabulary(tokenizer)
    return OPEN in vocab and CLOSE in vocab


def splitter_for(tokenizer: Any, prompt_ids: Sequence[int]) -> ThinkSplitter | None:
    """A splitter for a reply to `prompt_ids`, starting inside a block the prompt left open;
    None for a model that does not think in tags."""
    if not thinks(tokenizer):
        return None
    tail = tokenizer.decode(list(prompt_ids[-16:]))
    opened, closed = tail.rfind(OPEN), tail.rfind(CLOSE)
    return ThinkSplitter(inside=opened > closed)


# gpt-oss's harmony format: each message is <|start|>role<|channel|>name<|message|>text<|end|>; the
# reply's last one ends with <|return|> (or <|call|> for a tool call). The analysis channel is the
# model's reasoning, final (and commentary) its answer. A function call is a commentary message
# addressed to it, in its header or after its channel name, its content type after <|constrain|>:
#   <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
REASONING_CHANNELS = ("analysis",)
FUNCTIONS = "functions."  # the namespace gpt-oss's template gives the request's tools
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonySplitter:
    """Harmony messages split by their control tokens: (reasoning, answer) deltas per token, and
    the function calls (`calls`: {"name", "arguments"}, the arguments as the model wrote them).

    openai-harmony's StreamableParser does this from its own o200k encoding, which it downloads on
    first use; the model's tokenizer has the same control tokens, so the split needs no download.
    A message to a built-in tool (`to=browser.search`, `to=python`) is the model's own work, read as
    reasoning: no client asked for those tools."""

    def __init__(self, control_ids: dict[str, int]):
        self.control = {token_id: name for name, token_id in control_ids.items()}
        self.state = "header"  # header (role, recipient) | channel | body | between (after <|end|>)
        self.header = ""  # the message's header text: role, recipient, channel, content type
        self.channel = ""
        self.calls: list[dict[str, str]] = []
        self._call: dict[str, str] | None = None  # the function call whose arguments are arriving
        self._to_tool = False  # the message is addressed to a built-in tool

    def push(self, token_id: int, text: str) -> tuple[str, str]:
        """(reasoning, answer) for one token and its text (text a control token releases, such as
        a character's last bytes, belongs to the message before it)."""
        split = self._route(text)
        name = self.control.get(token_id)
        if name is not None:
            self.header += " "  # a control token's own text is skipped: keep the header's words apart
        if name == "<|channel|>":
            self.channel, self.state = "", "channel"
        elif name == "<|message|>":
            self.state = "body"
            self._open_message()
        elif name == "<|start|>":
            self.state, self.header, self.channel = "header", "", ""
        elif name in ("<|end|>", "<|return|>", "<|call|>"):
            self.finish()
            self.state = "between"
        return split  # <|constrain|> stays in the header: the content type follows it

    def tool_calls(self) -> tuple[dict[str, Any], ...]:
        """The calls in a chat message's `tool_calls` form: arguments an object, or the text as the
        model wrote it when that is not JSON (a call cut short)."""
        return tuple(
            {
                "id": f"call_{n}",
                "type": "function",
                "function": {"name": c["name"], "arguments": _json(c["arguments"])},
            }
            for n, c in enumerate(self.calls)
        )

    def finish(self) -> None:
        """End the message being read: a call cut short (at max_tokens) is still a call."""
        if self._call is not None:
            self.calls.append(self._call)
        self._call, self._to_tool = None, False

    def _open_message(self) -> None:
        found = _RECIPIENT.search(self.header)
        recipient = found.group(1) if found else ""
        if recipient.startswith(FUNCTIONS):
            self._call = {"name": recipient[len(FUNCTIONS) :], "arguments": ""}
        self._to_tool = bool(recipient) and self._call is None and recipient != "assistant"

    def _route(self, text: str) -> tuple[str, str]:
        if self.state in ("header", "channel"):
            self.header += text
        if self.state == "channel":
            self.channel += text
        if self.state != "body" or not text:
            return "", ""
        if self._call is not None:
            self._call["arguments"] += text
            return "", ""
        channel = self.channel.split()[0] if self.channel.split() else ""
        return (text, "") if channel in REASONING_CHANNELS or self._to_tool else ("", text)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def harmony_splitter_for(tokenizer: Any) -> HarmonySplitter | None:
    """A splitter for a model whose vocabulary has harmony's control tokens (gpt-oss)."""
    vocab = vocabulary(tokenizer)
    if not all(token in vocab for token in HARMONY[:4]):
        return None
    return HarmonySplitter({token: vocab[token] for token in HARMONY if token in vocab})


def one_call_per_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A history as gpt-oss's chat template can render it: the template writes one call per
    assistant message and names a tool's result after the call before it, so an assistant message
    with parallel calls becomes one message per call, each followed by its result (matched by
    `tool_call_id`; unmatched results keep their order after the calls)."""
    history: list[dict[str, Any]] = []
    at = 0
    while at < len(messages):
        message = messages[at]
        at += 1
        calls = message.get("tool_calls") or []
        if message.get("role") != "assistant" or len(calls) < 2:
            history.append(message)
            continue
        results = []
        while at < len(messages) and messages[at].get("role") == "tool":
            results.append(messages[at])
            at += 1
        for n, call in enumerate(calls):
            part = {**message, "tool_calls": [call]}
            if n > 0:  # what the model said (or thought) before its calls is written once
                part["content"] = ""
                part.pop("thinking", None)
            history.append(part)
            answer = next((r for r in results if r.get("tool_call_id") == call.get("id")), None)
            if answer is not None:
                results.remove(answer)
                history.append(answer)
        history.extend(results)
    return history
