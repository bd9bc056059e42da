"""Which resident expert the cache evicts: the policy's choice, narrowed.

`preferred_victims(candidates, crowded)` narrows the evictable slots before the policy chooses:
never a prefetched expert still waiting for its use while something else can go; transient
(streamed) slots before any other; then, for a policy that keeps per-layer shares (LRU), experts of
the `crowded` layers, those keeping more than their share. `oldest_preferred` gives the same choice
for a policy whose victim is the oldest candidate (LRU) without building those sets: the transient
slots are few and kept apart, and walking the policy's keys oldest first, the first that qualifies
is the choice. With thousands of slots (an 8 GiB cache of Q4_K experts holds ~2800) building the
sets costs far more an eviction than the walk, which stops after a few dozen keys.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from engine.device_cache.eviction import EvictionPolicy, ExpertKey
from engine.device_cache.slots import NoEvictableSlot, Slot, SlotState


def can_evict(slot: Slot) -> bool:
    """Unpinned, and ready (or its copy has landed)."""
    return slot.pins == 0 and (slot.state is SlotState.READY or slot.copy.done())


def preferred_victims(
    candidates: dict[ExpertKey, Slot], crowded: Collection[int] | None
) -> dict[ExpertKey, Slot]:
    """`candidates` narrowed as the module says; `crowded` None: the policy keeps no layer shares."""
    unprefetched = {k: s for k, s in candidates.items() if s.prefetch_phase is None} or candidates
    transient = {k: s for k, s in unprefetched.items() if s.transient}
    if transient:
        return transient
    if crowded is None:
        return unprefetched
    return {k: s for k, s in unprefetched.items() if k[0] in crowded} or unprefetched


def oldest_preferred(
    table: Mapping[ExpertKey, Slot],
    transient: Collection[ExpertKey],
    crowded: Collection[int] | None,
    policy: EvictionPolicy,
) -> ExpertKey:
    """What `preferred_victims` and a recency-ordered `policy` choose among `table`'s evictable
    slots (`transient`: the keys loaded as transient; `crowded`: as `preferred_victims` takes it)."""
    evictable_transient = [k for k in transient if can_evict(table[k])]
    unprefetched = [k for k in evictable_transient if table[k].prefetch_phase is None]
    if unprefetched:
        return policy.victim(unprefetched)
    crowded = crowded or ()
    first_unprefetched = first = first_crowded = None
    for key in policy.oldest_first():
        slot = table.get(key)
        if slot is None or not can_evict(slot):
            continue
        first = first or key
        if key[0] in crowded:
            first_crowded = first_crowded or key
        if slot.prefetch_phase is None:
            if not crowded or key[0] in crowded:
                return key
            first_unprefetched = first_unprefetched or key
    if first_unprefetched is not None:
        return first_unprefetched
    # every evictable slot holds a prefetch still waiting for its use: choose among them all
    if evictable_transient:
        return policy.victim(evictable_transient)
    if first_crowded is not None or first is not None:
        return first_crowded or first
    raise NoEvictableSlot
