"""Eviction bookkeeping for the device expert cache: which resident expert goes next.

Pure Python, no tensors: the slot pool does the memory moves and tells a policy
what happened through four calls, then asks it for a victim.

- `on_insert(key)`: `key` became resident (its copy into a slot started).
  Counts as an access for recency, not for LFU frequency.
- `on_access(key)`: compute used `key` (a hit, or a load just finished).
  O(1). An access to a key never inserted is taken as an implicit insert.
- `on_remove(key)`: `key` was evicted; the policy drops its per-key state.
  Removing an unknown key is a no-op.
- `observe_scores(layer, scores)`: routing scores of every expert of `layer`
  for this step, already averaged over tokens (pass a list: `t.tolist()`).
  Only `MRSPolicy` uses them.
- `victim(candidates)`: the key to evict among the evictable candidates (the
  caller excludes slots that are loading or in use). O(len(candidates)); always
  returns one of them; raises ValueError when there are none. Ties go to the
  least recently accessed key.

Per-key state exists only for keys inserted and not yet removed
(`tracked_keys()`), so it stays as large as the cache. `MRSPolicy` also keeps
one priority per (layer, expert) ever scored, bounded by the model's size.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence

from engine.config import CACHE_POLICIES

ExpertKey = tuple[int, int]  # (layer, expert)

POLICIES = CACHE_POLICIES


class EvictionPolicy(ABC):
    """Recency bookkeeping shared by every policy; subclasses define the eviction order."""

    name: str
    uses_scores = False  # True when observe_scores matters (the cache then feeds it routing scores)
    layer_share = False  # the cache offers victims of layers over their kept share first, and streams
    recency_ordered = False  # the victim is the oldest candidate: the cache may walk `oldest_first`

    def __init__(self) -> None:
        self._clock = 0
        self._last_access: dict[ExpertKey, int] = {}

    def _touch(self, key: ExpertKey) -> None:
        self._clock += 1
        self._last_access.pop(key, None)  # re-inserted last: the dict stays oldest first
        self._last_access[key] = self._clock

    def oldest_first(self) -> Iterator[ExpertKey]:
        """The tracked keys, least recently accessed first (do not change the policy meanwhile)."""
        return iter(self._last_access)

    def _recency(self, key: ExpertKey) -> int:
        # Unknown keys count as the oldest, so stale bookkeeping never protects a slot.
        return self._last_access.get(key, -1)

    def on_insert(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_access(self, key: ExpertKey) -> None:
        self._touch(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._last_access.pop(key, None)

    def observe_scores(self, layer: int, scores: Sequence[float]) -> None:  # noqa: B027 - optional hook
        """Routing scores of all experts of `layer` this step; ignored unless the policy uses them."""

    def tracked_keys(self) -> frozenset[ExpertKey]:
        """The keys this policy holds per-key state for (inserted and not removed)."""
        return frozenset(self._last_access)

    @abstractmethod
    def _rank(self, key: ExpertKey) -> tuple[float, ...]:
        """Eviction order: the candidate with the smallest rank is evicted."""

    def victim(self, candidates: Iterable[ExpertKey]) -> ExpertKey:
        chosen = min(candidates, key=self._rank, default=None)
        if chosen is None:
            raise ValueError("no evictable expert: every resident slot is loading or in use")
        return chosen


class LRUPolicy(EvictionPolicy):
    """Evict the least recently accessed expert (an insert counts as an access).

    `layer_share` asks the cache to offer only candidates of layers keeping more than their share
    of the slots (`ExpertCache.kept_share`): with that, LRU behaves as Mixtral-offloading's
    per-layer LRU groups, which survive a step that touches more experts than the cache holds."""

    name = "lru"
    layer_share = True
    recency_ordered = True

    def _rank(self, key: ExpertKey) -> tuple[float, ...]:
        return (self._recency(key),)


class LFUPolicy(EvictionPolicy):
    """Evict the expert with the fewest accesses since it became resident.

    Classic LFU: the count starts at 0 on insert and is forgotten on eviction, so a
    re-loaded expert starts again from 0 (state stays bounded by the cache size).
    Ties go to the least recently accessed expert.
    """

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._accesses: dict[ExpertKey, int] = {}

    def on_insert(self, key: ExpertKey) -> None:
        super().on_insert(key)
        self._accesses.setdefault(key, 0)

    def on_access(self, key: ExpertKey) -> None:
        super().on_access(key)
        self._accesses[key] = self._accesses.get(key, 0) + 1

    def on_remove(self, key: ExpertKey) -> None:
        super().on_remove(key)
        self._accesses.pop(key, None)

    def access_count(self, key: ExpertKey) -> int:
        return self._accesses.get(key, 0)

    def _rank(self, key: ExpertKey) -> tuple[float, ...]:
        return (self._accesses.get(key, 0), self._recency(key))


class MRSPolicy(EvictionPolicy):
    """HybriMoE's Minus Recent Score: evict the expert with the lowest decayed routing score.

    Per layer, each step: S = alpha * TopP(s) + (1 - alpha) * S, where TopP keeps the
    `top_p` largest scores and zeros the rest (the paper sets top_p = 2 * top_k:
    low-scoring experts are no likelier to be reused than each other). S belongs to
    the (layer, expert), not the slot: it survives eviction. Never scored: S = 0.
    Ties go to the least recently accessed expert.
    """

    name = "mrs"
    uses_scores = True

    def __init__(self, alpha: float = 0.5, top_p: int = 4) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"MRS alpha must be in (0, 1], got {alpha}")
        if top_p < 1:
            raise ValueError(f"MRS top_p must be at least 1, got {top_p}")
        super().__init__()
        self.alpha = alpha
        self.top_p = top_p
        self._priority: dict[int, list[float]] = {}  # layer -> S per expert

    def observe_scores(self, layer: int, scores: Sequence[float]) -> None:
        values = [float(s) for s in scores]  # [E]
        priority = self._priority.setdefault(layer, [0.0] * len(values))
        if len(priority) != len(values):
            raise ValueError(f"layer {layer}: got {len(values)} scores, expected {len(priority)}")
        keep = 1.0 - self.alpha
        priority[:] = [keep * s for s in priority]
        for expert in heapq.nlargest(self.top_p, range(len(values)), key=values.__getitem__):
            priority[expert] += self.alpha * values[expert]

    def priority(self, key: ExpertKey) -> float:
        """The current S of `key` (0.0 if its layer or expert was never scored)."""
        layer, expert = key
        scores = self._priority.get(layer)
        return scores[expert] if scores is not None and 0 <= expert < len(scores) else 0.0

    def _rank(self, key: ExpertKey) -> tuple[float, ...]:
        return (self.priority(key), self._recency(key))


def make_policy(name: str, *, top_k: int = 2, alpha: float = 0.5) -> EvictionPolicy:
    """Build a policy by name ("lru", "lfu", "mrs"; any case). MRS gets top_p = 2 * top_k."""
    match name.lower():
        case "lru":
            return LRUPolicy()
        case "lfu":
            return LFUPolicy()
        case "mrs":
            return MRSPolicy(alpha=alpha, top_p=2 * top_k)
    raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
