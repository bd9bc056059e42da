"""Streaming text out of a token stream: incremental detokenization and stop strings.

Contract:
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
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)


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
