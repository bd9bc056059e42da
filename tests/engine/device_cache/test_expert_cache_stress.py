"""Randomized use of the expert cache never breaks its invariants (seeded; both transfers, all policies)."""

from __future__ import annotations

import contextlib
import random

import pytest

from engine.device_cache.eviction import ExpertKey, LFUPolicy, LRUPolicy, MRSPolicy
from engine.device_cache.expert_cache import ExpertCache, NoEvictableSlot, Slot, SlotState
from engine.device_cache.transfer import SimulatedLink
from tests.engine.cache_helpers import (
    NUM_EXPERTS,
    NUM_LAYERS,
    ManualTransfer,
    make_cache,
    slot_matches_store,
)

# -- randomized invariants -----------------------------------------------------------------------


def check_invariants(cache: ExpertCache, pinned_keys: dict[int, ExpertKey]) -> None:
    assert cache.used_slots <= cache.n_slots
    assert len(cache.pool) == cache.n_slots + (cache.zero_row is not None)
    if cache.zero_row is not None:  # never a slot, never written
        assert cache.zero_row == cache.n_slots and not cache.pool[cache.zero_row].any()
    table = cache._table
    free = cache._free
    assert len({id(s) for s in free}) == len(free)
    assert {s.index for s in free}.isdisjoint(s.index for s in table.values())
    assert len(free) + len(table) == cache.n_slots
    for key, slot in table.items():
        assert slot.key == key and slot.state is not SlotState.FREE
    for slot in free:
        assert slot.state is SlotState.FREE and slot.key is None and slot.pins == 0
    for slot in cache.slots:
        assert slot.pins >= 0
        if slot.pins:
            assert pinned_keys[slot.index] == slot.key  # a pinned slot's key never changes
        if slot.state is SlotState.READY:
            assert slot_matches_store(cache, slot)
    assert set(cache.policy.tracked_keys()) == set(table)


@pytest.mark.parametrize("transfer_kind", ["manual", "simulated"])
@pytest.mark.parametrize("policy_cls", [LRUPolicy, LFUPolicy, MRSPolicy])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_use_never_breaks_the_invariants(store, transfer_kind, policy_cls, seed) -> None:
    rng = random.Random(seed)
    transfer = ManualTransfer() if transfer_kind == "manual" else SimulatedLink(gbps=None)
    policy = policy_cls()
    cache = make_cache(store, transfer, n_slots=4, policy=policy)
    held: list[Slot] = []  # acquisitions not yet released (a slot may appear more than once)
    pinned_keys: dict[int, ExpertKey] = {}
    refused = 0
    try:
        for _ in range(1500):
            action = rng.random()
            key = (rng.randrange(NUM_LAYERS), rng.randrange(NUM_EXPERTS))
            if action < 0.4:
                try:
                    slot = cache.acquire(key)
                except NoEvictableSlot:
                    refused += 1
                    assert all(s.pins or s.state is SlotState.LOADING for s in cache.slots)
                    continue
                assert slot.key == key
                held.append(slot)
                pinned_keys[slot.index] = key
            elif action < 0.6 and held:
                slot = rng.choice(held)
                cache.wait(slot)
                assert slot_matches_store(cache, slot)
            elif action < 0.85 and held:
                slot = held.pop(rng.randrange(len(held)))
                cache.release(slot)
            elif action < 0.92:
                was_resident = key in cache
                started = cache.prefetch(key)
                assert not (was_resident and started)
                if started:
                    assert cache._table[key].pins == 0
            elif action < 0.96 and isinstance(transfer, ManualTransfer) and transfer.in_flight():
                rng.choice(transfer.in_flight()).land()
            elif policy.uses_scores:
                layer = rng.randrange(NUM_LAYERS)
                policy.observe_scores(layer, [rng.random() for _ in range(NUM_EXPERTS)])
            check_invariants(cache, pinned_keys)
        for slot in held:
            cache.wait(slot)
            cache.release(slot)
        check_invariants(cache, pinned_keys)
    finally:
        if isinstance(transfer, SimulatedLink):
            transfer.close()
    stats = cache.stats.total()
    assert stats.bytes_copied == stats.copies * store.layout.nbytes
    assert stats.misses > 50 and stats.hits > 50 and refused > 0  # the run did exercise the cache


class CandidateSetLRU(LRUPolicy):
    """LRU chosen the general way: every candidate set built, the least recent taken."""

    recency_ordered = False


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_walking_oldest_first_evicts_what_the_candidate_sets_choose(store, seed) -> None:
    """The same random uses (streamed and kept misses, spare-only prefetches, expired prefetches,
    copies landing late) on two caches: LRU's walk and the candidate sets give the same table."""
    rng = random.Random(seed)
    transfers = [ManualTransfer(), ManualTransfer()]
    caches = [
        make_cache(store, transfers[0], n_slots=7),
        make_cache(store, transfers[1], 7, CandidateSetLRU()),
    ]
    held: list[list[Slot]] = [[], []]
    for _ in range(3000):
        action, key, streaming = (
            rng.random(),
            (rng.randrange(NUM_LAYERS), rng.randrange(NUM_EXPERTS)),
            rng.random() < 0.3,
        )
        pick = rng.random()
        for cache, transfer, mine in zip(caches, transfers, held, strict=True):
            if action < 0.4:
                with contextlib.suppress(NoEvictableSlot):
                    mine.append(cache.acquire(key, streaming))
            elif action < 0.7 and mine:
                slot = mine.pop(int(pick * len(mine)))
                cache.wait(slot)
                cache.release(slot)
            elif action < 0.85:
                cache.prefetch(key, spare_only=streaming)
            elif action < 0.9:
                cache.expire_prefetches(key[0], {key[1]})
            elif transfer.in_flight():
                transfer.in_flight()[int(pick * len(transfer.in_flight()))].land()
        tables = [{k: (s.index, s.transient, s.prefetch_phase) for k, s in c._table.items()} for c in caches]
        assert tables[0] == tables[1]
        assert caches[0]._transient == {k for k, s in caches[0]._table.items() if s.transient}
    assert caches[0].stats.total().misses > 300
