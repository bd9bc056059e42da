"""Prefix reuse: the KV caches of the latest replies, so a new turn prefills only what is new.

Contract: `take(prompt_ids, rewindable)` hands out a cache holding the longest prefix of the
prompt that a kept cache holds too, and how many tokens that is (0 with a fresh cache or the
spare below); the
generation then prefills only the rest. At least one prompt token is always left to prefill: the
first reply token comes from its logits. `put(ids, cache, rewindable)` keeps a reply's cache once
it ended cleanly, `ids` being the tokens it holds. A taken cache is the caller's: it is never
shared, so a failed generation just drops it.

Attention layers are cropped to the common prefix; a sliding window that has passed its window
cannot be (it keeps only the last positions), so such a cache is reused whole. A linear-attention
or Mamba state cannot be cropped: such a cache is reused at the length it holds, or at a length
where a `RecurrentState` was saved (`save_point`, taken after the prompt's prefill, which is what a
regenerate or an edited last message reuses). `rewindable` caches (full sliding windows, for
speculative decoding) and plain ones are not mixed.

Kept caches are evicted least recently used first, beyond `max_entries` or `max_bytes`.

A cache let go (evicted, replaced by a longer one of the same reply, or cleared) leaves its
memory as the spare, with no positions: `take` hands it out where no kept cache shares a prefix
with the prompt, so a new conversation's prefill writes where the last one's did, as llama.cpp's
one KV cache is reused, instead of allocating its buffers again — and a CPU decode step's ggml
graph, kept per cache buffers (engine.decode.graph_chain), runs again instead of being built.
Only caches of
`GrowingLayer`s alone (what a cleared cache holds is then only its buffers) and of at most
`SPARE_MAX_BYTES`; `close()` lets the spare go too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from engine.model.kv_cache import (
    GrowingLayer,
    RecurrentState,
    has_recurrent_state,
    is_croppable,
    rewind_cache,
)

DEFAULT_MAX_ENTRIES = 4
DEFAULT_MAX_BYTES = 2 * 2**30
SPARE_MAX_BYTES = 256 * 2**20  # ~2,700 positions of Qwen3-30B-A3B's bf16 keys and values


@dataclass
class _Entry:
    ids: tuple[int, ...]
    cache: DynamicCache
    rewindable: bool
    saved: dict[int, RecurrentState] = field(default_factory=dict)  # length -> recurrent state there
    nbytes: int = 0

    def reusable(self, prompt: Sequence[int]) -> int:
        """How many of the prompt's first tokens this cache can hold for it (one always left)."""
        common = _common_prefix(self.ids, prompt)
        limit = min(common, len(prompt) - 1)
        if not has_recurrent_state(self.cache) and is_croppable(self.cache):
            return limit
        whole = (len(self.ids),) if self.cache.get_seq_length() == len(self.ids) else ()
        return max((n for n in (*whole, *self.saved) if n <= limit), default=0)


class PrefixCache:
    """The kept caches of one model, most recently used last."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: list[_Entry] = []
        self._spare: _Entry | None = None  # a let-go cache's memory, with no positions

    def take(self, prompt: Sequence[int], rewindable: bool) -> tuple[DynamicCache | None, int]:
        """The kept cache sharing the longest prefix with `prompt`, cut to it, and its length; where
        none shares a token, the spare (once) or (None, 0)."""
        best, reused = None, 0
        for entry in self._entries:
            if entry.rewindable == rewindable and (n := entry.reusable(prompt)) > reused:
                best, reused = entry, n
        if best is None:
            spare = self._spare
            if spare is None or spare.rewindable != rewindable:
                return None, 0
            self._spare = None
            return spare.cache, 0
        self._entries.remove(best)
        rewind_cache(best.cache, reused, best.saved.get(reused))
        return best.cache, reused

    def put(
        self,
        ids: Sequence[int],
        cache: DynamicCache,
        rewindable: bool,
        saved: Sequence[RecurrentState] = (),
    ) -> None:
        """Keep `cache`, which holds `ids` (a speculative step may have gone past the reply's end:
        those positions are cropped, or for a recurrent cache left to its saved states);
        `saved`: recurrent states it can go back to."""
        ids = tuple(ids[: cache.get_seq_length()])
        if not ids or self.max_entries < 1:
            return
        if not has_recurrent_state(cache):
            rewind_cache(cache, len(ids))
        points = {s.length: s for s in saved if s.length <= len(ids)}
        entry = _Entry(
            ids, cache, rewindable, points, _nbytes(cache) + sum(map(_state_bytes, points.values()))
        )
        for replaced in [e for e in self._entries if e.ids == ids]:
            self._entries.remove(replaced)
            self._let_go(replaced)
        self._entries.append(entry)
        while self._entries and (
            len(self._entries) > self.max_entries or sum(e.nbytes for e in self._entries) > self.max_bytes
        ):
            self._let_go(self._entries.pop(0))

    def clear(self) -> None:
        """Drop every kept cache; the memory of the latest one that may be the spare stays as the spare."""
        for entry in reversed(self._entries):
            if self._let_go(entry):
                break
        self._entries.clear()

    def close(self) -> None:
        """Drop every kept cache and the spare."""
        self._entries.clear()
        self._spare = None

    def _let_go(self, entry: _Entry) -> bool:
        """`entry`'s cache leaves its memory as the spare where it may (see the module); whether
        it did."""
        cache = entry.cache
        if not cache.layers or any(type(layer) is not GrowingLayer for layer in cache.layers):
            return False
        if entry.nbytes > SPARE_MAX_BYTES:
            return False
        rewind_cache(cache, 0)
        self._spare = _Entry((), cache, entry.rewindable)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries)


def save_point(cache: DynamicCache) -> RecurrentState | None:
    """A recurrent cache's state now (after a prompt's prefill), for a later reuse of that prompt."""
    return RecurrentState.save(cache)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(cache: DynamicCache) -> int:
    """Bytes of every tensor the cache's layers hold (keys, values, states)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in _tensors(vars(layer)))


def _state_bytes(state: RecurrentState) -> int:
    return sum(t.numel() * t.element_size() for _, fields in state.layers for t in _tensors(fields))
