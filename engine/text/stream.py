"""Text at the engine's edges: a chat prompt into ids, and streaming text out of a token stream.

Contract:
- `encode_chat(tokenizer, messages)` gives the chat-templated prompt ids, with a control token
  typed in a message (`<|im_end|>` …) kept as plain text: only the template puts control tokens
  in a prompt. A conversation without one gets exactly `apply_chat_template`'s ids.
- `IncrementalDetokenizer.push(id)` returns only complete text: a character whose UTF-8 bytes
  span several byte-level (or byte-fallback) tokens is held back until it is whole, and the
  concatenation of every delta plus `flush()` equals `tokenizer.decode(all_ids)` (up to the
  tokenizer's own clean-up rules). Each push decodes a small window of recent ids, not the
  whole sequence: `prefix_offset..read_offset` is text already emitted, kept as context so
  decoders that strip or add a leading space (SentencePiece's ▁) see the same thing a full
  decode sees; `read_offset..` is pending (vLLM / TGI incremental detokenization).
- A trailing U+FFFD means "incomplete character" while it is young. A U+FFFD that is still
  there after `_MAX_CHAR_TOKENS` more tokens is final (a literal U+FFFD or invalid bytes) and is
  released; `flush()` releases whatever is left.
- `StopStringMatcher.feed(delta)` never emits any part of a stop string: it holds back the
  longest tail that could begin one and, once a stop string completes, emits the text before it
  and reports stopped.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes and every byte-level token carries at least one byte, so
# an incomplete character at the end of ids[:n] is settled once 3 more tokens have arrived.
_MAX_CHAR_TOKENS = 3


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas that are always valid, complete UTF-8:
    a multi-byte character split across byte-level tokens is held back until it is whole."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._decode_ids = _plain_decode(tokenizer)
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window (already emitted)
        self._read_offset = 0  # everything before this has been emitted
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (may be "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            return self._emit(new_text[len(prefix_text) :], len(self._ids))
        if len(self._ids) - self._read_offset > _MAX_CHAR_TOKENS:
            return self._release_settled(prefix_text, new_text)
        return ""

    def flush(self) -> str:
        """At the end of generation: whatever is left, incomplete bytes decoded with 'replace'."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        return self._emit(new_text[len(prefix_text) :], len(self._ids))

    def _release_settled(self, prefix_text: str, new_text: str) -> str:
        """Emit the text of all but the last few pending tokens if more bytes can no longer change it.

        Reached only while the text keeps ending in U+FFFD: without this a literal U+FFFD (or a
        run of invalid bytes) would stall the stream until the end.
        """
        cut = len(self._ids) - _MAX_CHAR_TOKENS
        settled_text = self._decode(self._prefix_offset, cut)
        if len(settled_text) <= len(prefix_text) or not new_text.startswith(settled_text):
            return ""
        return self._emit(settled_text[len(prefix_text) :], cut)

    def _emit(self, delta: str, read_offset: int) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._decode_ids(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)


_FORCED_BPE_CLEAN_UP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def _plain_decode(tokenizer: Any):
    """The tokenizer's `decode`, or its Rust backend's where the two give the same text: a fast
    tokenizer whose `_decode` is transformers' own and that cleans up no spaces (BPE never does).
    The backend's call takes a third of the wrapper's time, and a reply decodes twice a token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    own = getattr(type(tokenizer), "_decode", None)
    if backend is None or getattr(own, "__qualname__", "") != "TokenizersBackend._decode":
        return tokenizer.decode
    bpe = type(backend.model).__name__ == "BPE"
    forced = getattr(tokenizer, _FORCED_BPE_CLEAN_UP, False)
    if tokenizer.clean_up_tokenization_spaces and (not bpe or forced):
        return tokenizer.decode
    return backend.decode


class StopStringMatcher:
    """Holds back text that could be the start of a stop string, so a stop string is never shown."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {list(stop_strings)!r}")
        self.stop_strings = tuple(dict.fromkeys(stop_strings))
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta; return (text safe to emit now, stopped?)."""
        if self.stopped:
            return "", True
        buffer = self._held + delta
        hit = self._first_match(buffer)
        if hit is not None:
            index, stop = hit
            self._held, self.stopped, self.matched = "", True, stop
            return buffer[:index], True
        keep = self._partial_tail_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """Held-back text at the end of a stream that did not stop ("" after a stop)."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            index = buffer.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_tail_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:length]):
                    longest = length
                    break
        return longest


# -- chat prompts into ids ----------------------------------------------------------------------

Message = dict[str, str]


def encode_chat(tokenizer: Any, messages: Sequence[Message], **template_kwargs: Any) -> list[int]:
    """Prompt ids of `messages` through the chat template, control tokens in contents as text;
    `template_kwargs` go to the template (`enable_thinking`, `reasoning_effort` …).

    A content holding a control token's string is rendered as a marker, the text is cut at the
    template's own control tokens, and each piece between two of them (contents put back) is
    tokenized with control tokens split into ordinary text, as the tokenizer treats the text
    between two added tokens. (A SentencePiece 'first' prepend scheme adds a ▁ at each piece.)
    """
    controls = control_tokens(tokenizer)
    if not controls:
        return _templated_ids(tokenizer, messages, template_kwargs)
    control = re.compile("|".join(map(re.escape, controls)))  # longest first: leftmost-longest
    typed = {}  # message index -> a control token its content holds
    for n, message in enumerate(messages):
        if role_token := _first_control(message.get("role"), control):
            raise InvalidRequestError(
                f"Message {n + 1}'s role contains the control token {role_token!r}: "
                "a role is a plain name such as user or assistant."
            )
        if content_token := _first_control(message.get("content"), control):
            typed[n] = content_token
    if not typed:
        return _templated_ids(tokenizer, messages, template_kwargs)
    nonce = secrets.token_hex(8)  # markers: letters and digits, so templates that escape keep them
    marked = [{**m, "content": f"{nonce}x{n}x"} if n in typed else m for n, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(
        marked, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    pieces = re.split(f"{nonce}x(\\d+)x", rendered)  # template text, message index, template text …
    if any(nonce[:8] in piece.lower() for piece in pieces[0::2]):  # the template changed a marker
        n, token = next(iter(typed.items()))
        raise InvalidRequestError(
            f"Message {n + 1} contains the control token {token!r}, which this model's chat template "
            "cannot take as plain text: remove it from the message."
        )
    segments = [  # odd pieces are message indices: their contents go back in
        (messages[int(piece)]["content"], True) if i % 2 else (piece, False) for i, piece in enumerate(pieces)
    ]
    return _ids_with_plain_contents(tokenizer, segments, control)


def control_tokens(tokenizer: Any) -> list[str]:
    """The strings the tokenizer reads as special tokens, longest first."""
    names = set(tokenizer.all_special_tokens)
    names.update(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)
    return sorted((name for name in names if name), key=len, reverse=True)


def _first_control(text: object, control: re.Pattern) -> str | None:
    """The first control token in `text`, when it is a string that holds one."""
    match = control.search(text) if isinstance(text, str) else None
    return match.group() if match else None


def _templated_ids(tokenizer: Any, messages: Sequence[Message], template_kwargs: dict[str, Any]) -> list[int]:
    ids = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, **template_kwargs
    )
    return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids


def _ids_with_plain_contents(
    tokenizer: Any, segments: Sequence[tuple[str, bool]], control: re.Pattern
) -> list[int]:
    """Ids of the joined segments (text, is_content): only control tokens outside contents count."""
    ids: list[int] = []
    plain = ""  # text since the template's last control token
    for text, is_content in segments:
        if is_content:
            plain += text
            continue
        start = 0
        for match in control.finditer(text):
            ids += _plain_ids(tokenizer, plain + text[start : match.start()])
            ids.append(tokenizer.convert_tokens_to_ids(match.group()))
            plain, start = "", match.end()
        plain += text[start:]
    return ids + _plain_ids(tokenizer, plain)


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
