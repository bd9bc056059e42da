"""Prefix reuse: the KV caches of the latest replies, so a new turn prefills only what is new.

Contract: `take(prompt_ids, rewindable)` hands out a cache holding the longest prefix of the
prompt that a kept cache holds too, and how many tokens that is (0 with a fresh cache); the
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from engine.model.kv_cache import RecurrentState, has_recurrent_state, is_croppable, rewind_cache

DEFAULT_MAX_ENTRIES = 4
DEFAULT_MAX_BYTES = 2 * 2**30


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

    def take(self, prompt: Sequence[int], rewindable: bool) -> tuple[DynamicCache | None, int]:
        """The kept cache sharing the longest prefix with `prompt`, cut to it, and its length;
        (None, 0) when none shares a token."""
        best, reused = None, 0
        for entry in self._entries:
            if entry.rewindable == rewindable and (n := entry.reusable(prompt)) > reused:
                best, reused = entry, n
        if best is None:
            return None, 0
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
        self._entries = [e for e in self._entries if e.ids != ids] + [entry]
        while self._entries and (
            len(self._entries) > self.max_entries or sum(e.nbytes for e in self._entries) > self.max_bytes
        ):
            self._entries.pop(0)

    def clear(self) -> None:
        self._entries.clear()

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
