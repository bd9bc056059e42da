"""The expert cache's counters, kept per phase: what `engine.metrics` computes its figures from.

A phase is what the engine was doing when an expert was used or copied: `prefill`,
`decode` (plain decoding), `draft` or `verify` (speculative decoding). The cache counts in
the phase `ExpertCache.in_phase` scopes; a prefetch counts in the phase that asked for it.

Prefetch accounting: every prefetched expert ends up either *used* (acquired by
compute before it left the cache) or *wasted* (evicted, cleared or settled
unused), counted in the phase that issued it, so `prefetched == prefetch_used +
prefetch_wasted` once `settle_prefetches()` has run. The first use of a
prefetched expert also counts as a `prefetch_hit` in the phase that used it
(`prefetch_recall` = verify-phase prefetch hits / verify-phase uses).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, fields

PHASES = ("prefill", "decode", "draft", "verify")


@dataclass
class PhaseCounters:
    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    copies: int = 0
    prefetched: int = 0  # experts this phase asked to prefetch that were copied
    prefetch_used: int = 0  # of those, used by compute before leaving the cache
    prefetch_wasted: int = 0  # of those, evicted, cleared or settled unused
    prefetch_hits: int = 0  # uses in this phase that were a prefetched expert's first use
    cpu_computed: int = 0  # misses computed on the CPU from the host store instead of copied

    def add(self, other: PhaseCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def uses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.uses if self.uses else None


@dataclass
class CacheStats:
    phases: dict[str, PhaseCounters] = field(default_factory=lambda: defaultdict(PhaseCounters))

    def total(self) -> PhaseCounters:
        total = PhaseCounters()
        for counters in self.phases.values():
            total.add(counters)
        return total
