"""The device expert cache on a hand-made store: slot states, hits and misses, eviction, counters.

No model is needed: a store of three layers × six experts of random floats is packed by
`ExpertLayout.from_shapes`. Copies go through the simulated link at memcpy speed, or through
`ManualTransfer`, whose copies land only when a test says so, to hold a slot in LOADING.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.errors import DeviceOutOfMemoryError
from engine.eviction import EvictionPolicy, ExpertKey, LFUPolicy, LRUPolicy, MRSPolicy
from engine.expert_cache import ExpertCache, NoEvictableSlot, Slot, SlotState
from engine.expert_store import ALIGN, ExpertLayout, ExpertStore
from engine.transfer import CopyHandle, SimulatedLink, TransferEngine

NUM_LAYERS, NUM_EXPERTS = 3, 6
SHAPES = {"gate_up_proj": (10, 6), "down_proj": (6, 5), "down_proj_bias": (6,)}


def make_store(seed: int = 0) -> ExpertStore:
    layout = ExpertLayout.from_shapes(SHAPES, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for layer in range(NUM_LAYERS):
        # Random bytes everywhere (padding included), then random floats in the fields: no NaNs,
        # so typed views compare with torch.equal, while the raw bytes check the whole buffer.
        packed = torch.randint(0, 256, (NUM_EXPERTS, layout.nbytes), dtype=torch.uint8, generator=generator)
        for expert in range(NUM_EXPERTS):
            for view in layout.views(packed[expert]).values():
                view.copy_(torch.randn(view.shape, generator=generator))
        layers[layer] = packed
    return ExpertStore(layout, layers, NUM_EXPERTS)


class ManualCopy(CopyHandle):
    """A copy that lands when the test calls `land()` (or when a consumer waits for it)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, after: object | None):
        self.dst, self.src, self.after = dst, src, after
        self.landed = False

    def land(self) -> None:
        if not self.landed:
            self.dst.copy_(self.src)
            self.landed = True

    def wait(self) -> None:
        self.land()  # a blocking wait: returns once the copy is in

    def done(self) -> bool:
        return self.landed


class ManualTransfer(TransferEngine):
    simulated = True

    def __init__(self) -> None:
        self.copies: list[ManualCopy] = []
        self.markers = 0

    def copy(self, dst, src, after=None) -> ManualCopy:
        handle = ManualCopy(dst, src, after)
        self.copies.append(handle)
        return handle

    def release_marker(self) -> object:
        self.markers += 1
        return ("released", self.markers)

    def in_flight(self) -> list[ManualCopy]:
        return [c for c in self.copies if not c.landed]


@pytest.fixture
def store() -> ExpertStore:
    return make_store()


@pytest.fixture
def link():
    link = SimulatedLink(gbps=None)
    yield link
    link.close()


def make_cache(
    store: ExpertStore,
    transfer: TransferEngine,
    n_slots: int = 3,
    policy: EvictionPolicy | None = None,
) -> ExpertCache:
    return ExpertCache(store, n_slots, torch.device("cpu"), transfer, policy or LRUPolicy())


def use(cache: ExpertCache, key: ExpertKey) -> Slot:
    """One complete use by compute: acquire, wait for the copy, release."""
    slot = cache.acquire(key)
    cache.wait(slot)
    cache.release(slot)
    return slot


def slot_matches_store(cache: ExpertCache, slot: Slot) -> bool:
    layer, expert = slot.key
    if not torch.equal(cache.pool[slot.index], cache.store.buffer(layer, expert)):
        return False
    expected = cache.store.views(layer, expert)
    return all(torch.equal(view, expected[name]) for name, view in slot.views.items())


def counters(cache: ExpertCache, phase: str = "decode") -> tuple[int, int, int, int]:
    c = cache.stats.phases[phase]
    return c.hits, c.misses, c.bytes_copied, c.copies


# -- the store and the pool ---------------------------------------------------------------------


def test_layout_packs_fields_aligned_and_views_alias_the_buffer(store) -> None:
    layout = store.layout
    assert [f.name for f in layout.fields] == list(SHAPES)
    assert all(f.offset % ALIGN == 0 for f in layout.fields)
    assert layout.nbytes % ALIGN == 0
    assert layout.nbytes >= sum(f.nbytes for f in layout.fields)
    views = store.views(1, 2)
    assert {name: tuple(v.shape) for name, v in views.items()} == SHAPES
    views["down_proj_bias"][0] = 123.0  # a view writes into the packed row
    assert store.views(1, 2)["down_proj_bias"][0] == 123.0
    assert store.total_experts == NUM_LAYERS * NUM_EXPERTS
    assert store.nbytes == NUM_LAYERS * NUM_EXPERTS * layout.nbytes
    assert not store.pinned


def test_pool_is_n_slots_of_one_expert_each(store, link) -> None:
    cache = make_cache(store, link, n_slots=4)
    assert tuple(cache.pool.shape) == (4, store.layout.nbytes)
    assert cache.pool.dtype == torch.uint8
    assert [s.state for s in cache.slots] == [SlotState.FREE] * 4
    assert cache.used_slots == 0 and cache.resident() == []
    for slot in cache.slots:  # each slot's views alias its own row of the pool
        assert slot.views["gate_up_proj"].data_ptr() == cache.pool[slot.index].data_ptr()


def test_pool_allocation_oom_is_a_device_out_of_memory_error(store, link, monkeypatch) -> None:
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 TiB")

    monkeypatch.setattr(torch, "empty", no_memory)
    with pytest.raises(DeviceOutOfMemoryError, match="expert cache"):
        make_cache(store, link, n_slots=4)


# -- slot states, hits and misses ----------------------------------------------------------------


def test_miss_goes_free_loading_ready_and_copies_one_expert_bit_exact(store, link) -> None:
    cache = make_cache(store, link)
    key = (1, 4)
    assert key not in cache

    slot = cache.acquire(key)
    assert slot.state is SlotState.LOADING  # until wait(), whether or not the copy has landed
    assert slot.key == key and slot.pins == 1 and key in cache
    assert counters(cache) == (0, 1, store.layout.nbytes, 1)

    views = cache.wait(slot)
    assert slot.state is SlotState.READY and slot.copy is None
    assert views is slot.views
    assert slot_matches_store(cache, slot)
    cache.release(slot)
    assert slot.pins == 0 and slot.state is SlotState.READY
    assert [s.state for s in cache.slots].count(SlotState.FREE) == 2


def test_miss_copies_exactly_the_experts_buffer(store) -> None:
    transfer = ManualTransfer()
    cache = make_cache(store, transfer)
    slot = cache.acquire((2, 5))
    (copy,) = transfer.copies
    assert copy.src.data_ptr() == store.buffer(2, 5).data_ptr()
    assert copy.src.numel() == copy.dst.numel() == store.layout.nbytes
    assert copy.dst.data_ptr() == cache.pool[slot.index].data_ptr()
    cache.wait(slot)
    assert slot_matches_store(cache, slot)


def test_hit_pins_without_copying(store) -> None:
    transfer = ManualTransfer()
    cache = make_cache(store, transfer)
    first = use(cache, (0, 1))
    assert len(transfer.copies) == 1

    again = cache.acquire((0, 1))
    assert again is first and again.pins == 1
    assert len(transfer.copies) == 1  # no copy on a hit
    assert counters(cache) == (1, 1, store.layout.nbytes, 1)
    twice = cache.acquire((0, 1))  # pins nest
    assert twice is first and first.pins == 2
    cache.wait(first)
    cache.release(first)
    assert first.pins == 1 and transfer.markers == 1  # the marker is taken when the last user leaves
    cache.release(first)
    assert first.pins == 0 and transfer.markers == 2


def test_hit_on_a_copy_in_flight_counts_as_a_hit_and_waits_for_it(store) -> None:
    transfer = ManualTransfer()
    cache = make_cache(store, transfer)
    assert cache.prefetch((0, 3))
    (copy,) = transfer.copies
    assert not copy.landed

    slot = cache.acquire((0, 3))
    assert slot.state is SlotState.LOADING
    assert counters(cache)[:2] == (1, 0)
    cache.wait(slot)
    assert copy.landed and slot.state is SlotState.READY
    assert slot_matches_store(cache, slot)


# -- eviction ---------------------------------------------------------------------------------


def test_loading_and_pinned_slots_are_never_evicted(store) -> None:
    transfer = ManualTransfer()
    cache = make_cache(store, transfer, n_slots=3)
    pinned = cache.acquire((0, 0))
    cache.wait(pinned)  # READY but in use
    assert cache.prefetch((0, 1))  # LOADING, not in use, copy in flight
    assert cache.prefetch((0, 2))
    loading = [cache._table[(0, 1)], cache._table[(0, 2)]]
    assert [s.state for s in loading] == [SlotState.LOADING] * 2

    with pytest.raises(NoEvictableSlot):
        cache.acquire((1, 0))
    assert not cache.prefetch((1, 0))
    assert sorted(cache.resident()) == [(0, 0), (0, 1), (0, 2)]
    assert counters(cache) == (0, 1, 3 * store.layout.nbytes, 3)  # the refused miss counted nothing
    assert pinned.key == (0, 0) and all(s.key in ((0, 1), (0, 2)) for s in loading)

    # The in-flight copy that lands becomes evictable even before anyone waits for it.
    transfer.copies[1].land()
    slot = cache.acquire((1, 0))
    assert slot is loading[0] and (0, 1) not in cache
    assert (0, 2) in cache and (0, 0) in cache


def test_slow_link_copy_in_flight_is_not_evicted(store) -> None:
    slow = SimulatedLink(gbps=store.layout.nbytes / 0.3 / 1e9)  # each copy takes 0.3 s
    try:
        cache = make_cache(store, slow, n_slots=1)
        assert cache.prefetch((2, 2))
        with pytest.raises(NoEvictableSlot):
            cache.acquire((2, 3))
        slot = cache.acquire((2, 2))
        cache.wait(slot)
        assert slot_matches_store(cache, slot)
        cache.release(slot)
        assert cache.acquire((2, 3)) is slot  # READY and released: now it can go
    finally:
        slow.close()


def test_every_slot_pinned_raises_and_release_makes_room(store, link) -> None:
    cache = make_cache(store, link, n_slots=2)
    a, b = cache.acquire((0, 0)), cache.acquire((0, 1))
    cache.wait(a)
    cache.wait(b)
    with pytest.raises(NoEvictableSlot):
        cache.acquire((0, 2))
    cache.release(b)
    c = cache.acquire((0, 2))
    assert c is b and c.key == (0, 2) and a.key == (0, 0)
    cache.wait(c)
    assert slot_matches_store(cache, c) and slot_matches_store(cache, a)


def test_copy_into_a_reused_slot_waits_for_its_last_release(store) -> None:
    transfer = ManualTransfer()
    cache = make_cache(store, transfer, n_slots=1)
    slot = use(cache, (0, 0))
    marker = slot.released
    assert marker is not None
    assert transfer.copies[0].after is None  # a fresh slot has no previous user
    cache.acquire((0, 1))
    assert transfer.copies[1].after == marker


def test_lru_evicts_the_least_recently_used(store, link) -> None:
    cache = make_cache(store, link, n_slots=3, policy=LRUPolicy())
    for key in [(0, 0), (0, 1), (0, 2), (0, 0)]:
        use(cache, key)
    use(cache, (1, 0))
    assert sorted(cache.resident()) == [(0, 0), (0, 2), (1, 0)]  # (0, 1) was the oldest


def test_lfu_evicts_the_least_frequently_used(store, link) -> None:
    cache = make_cache(store, link, n_slots=3, policy=LFUPolicy())
    for key in [(0, 0), (0, 0), (0, 0), (0, 1), (0, 1), (0, 2), (0, 2), (0, 2)]:
        use(cache, key)
    use(cache, (1, 0))  # (0, 1) was used twice, the others three times
    assert sorted(cache.resident()) == [(0, 0), (0, 2), (1, 0)]
    use(cache, (1, 1))  # the newcomer, used once, goes next although it is the most recent
    assert sorted(cache.resident()) == [(0, 0), (0, 2), (1, 1)]


def test_mrs_evicts_the_lowest_routing_score(store, link) -> None:
    policy = MRSPolicy(alpha=0.5, top_p=2)
    cache = make_cache(store, link, n_slots=3, policy=policy)
    for key in [(0, 0), (0, 1), (0, 2)]:
        use(cache, key)
    policy.observe_scores(0, [0.1, 0.5, 0.4, 0.0, 0.0, 0.0])  # keeps experts 1 and 2
    use(cache, (0, 0))  # most recent, but never among the top scores: LRU would keep it
    use(cache, (1, 0))
    assert sorted(cache.resident()) == [(0, 1), (0, 2), (1, 0)]


# -- prefetch -----------------------------------------------------------------------------------


def test_prefetch_loads_without_counting_a_use(store, link) -> None:
    cache = make_cache(store, link, n_slots=2)
    assert cache.prefetch((1, 1))
    assert counters(cache) == (0, 0, store.layout.nbytes, 1)  # a copy, but no hit and no miss
    slot = cache._table[(1, 1)]
    assert slot.state is SlotState.LOADING and slot.pins == 0
    assert not cache.prefetch((1, 1))  # already resident (or on its way): nothing to do
    assert counters(cache)[3] == 1

    got = cache.acquire((1, 1))
    assert got is slot and counters(cache)[:2] == (1, 0)
    cache.wait(got)
    assert slot_matches_store(cache, got)
    cache.release(got)


def test_prefetch_evicts_a_ready_slot_but_not_one_in_use(store, link) -> None:
    cache = make_cache(store, link, n_slots=1)
    use(cache, (0, 0))
    assert cache.prefetch((0, 1))  # (0, 0) is READY and unpinned: evicted
    assert cache.resident() == [(0, 1)]
    slot = cache.acquire((0, 1))
    assert not cache.prefetch((0, 2))  # the only slot is in use: no room
    assert cache.resident() == [(0, 1)]
    cache.wait(slot)
    cache.release(slot)


# -- counters, clear --------------------------------------------------------------------------


def test_counters_are_kept_per_phase(store, link) -> None:
    cache = make_cache(store, link, n_slots=2)
    nbytes = store.layout.nbytes
    cache.phase = "prefill"
    for key in [(0, 0), (0, 1), (0, 0)]:
        use(cache, key)
    cache.phase = "decode"
    for key in [(0, 0), (0, 2), (0, 2), (0, 1)]:
        use(cache, key)
    cache.phase = "draft"
    cache.prefetch((1, 1))

    assert counters(cache, "prefill") == (1, 2, 2 * nbytes, 2)
    assert counters(cache, "decode") == (2, 2, 2 * nbytes, 2)
    assert counters(cache, "draft") == (0, 0, nbytes, 1)
    assert cache.stats.phases["prefill"].hit_rate == pytest.approx(1 / 3)
    assert cache.stats.phases["verify"].hit_rate is None
    total = cache.stats.total()
    assert (total.hits, total.misses, total.bytes_copied, total.copies) == (3, 4, 5 * nbytes, 5)
    assert total.bytes_copied == total.copies * nbytes


def test_clear_forgets_every_expert(store) -> None:
    transfer = ManualTransfer()
    policy = LRUPolicy()
    cache = make_cache(store, transfer, n_slots=3, policy=policy)
    use(cache, (0, 0))
    use(cache, (0, 1))
    cache.prefetch((0, 2))  # still in flight: clear() waits for it
    cache.clear()

    assert cache.used_slots == 0 and cache.resident() == []
    assert all(s.state is SlotState.FREE and s.key is None and s.pins == 0 for s in cache.slots)
    assert not transfer.in_flight()
    assert policy.tracked_keys() == frozenset()
    before = counters(cache)
    slot = cache.acquire((0, 0))  # what was resident is a miss again
    assert counters(cache)[1] == before[1] + 1
    cache.wait(slot)
    assert slot_matches_store(cache, slot)
    for key in [(1, 0), (1, 1)]:  # every slot is free again
        cache.acquire(key)
    assert cache.used_slots == 3


def test_clear_survives_a_failed_copy(store) -> None:
    class FailingTransfer(ManualTransfer):
        def copy(self, dst, src, after=None):
            handle = super().copy(dst, src, after)
            handle.land = lambda: (_ for _ in ()).throw(RuntimeError("link lost"))
            return handle

    cache = make_cache(store, FailingTransfer(), n_slots=2)
    slot = cache.acquire((0, 0))
    with pytest.raises(RuntimeError, match="link lost"):
        cache.wait(slot)
    cache.release(slot)
    cache.prefetch((0, 1))
    cache.clear()  # recovering from the error must not raise it again
    assert cache.used_slots == 0
    assert all(s.state is SlotState.FREE and s.key is None for s in cache.slots)


# -- randomized invariants -----------------------------------------------------------------------


def check_invariants(cache: ExpertCache, pinned_keys: dict[int, ExpertKey]) -> None:
    assert cache.used_slots <= cache.n_slots
    assert len(cache.pool) == cache.n_slots
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
