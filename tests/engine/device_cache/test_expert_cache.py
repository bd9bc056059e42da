"""The device expert cache on a hand-made store: slot states, hits and misses, eviction, counters.

No model is needed: a store of three layers × six experts of random floats is packed by
`ExpertLayout.from_shapes`. Copies go through the simulated link at memcpy speed, or through
`ManualTransfer`, whose copies land only when a test says so, to hold a slot in LOADING.
"""

from __future__ import annotations

import pytest
import torch

from engine.device_cache.eviction import LFUPolicy, LRUPolicy, MRSPolicy
from engine.device_cache.expert_cache import ExpertCache, NoEvictableSlot, SlotState
from engine.device_cache.transfer import SimulatedLink
from engine.errors import DeviceOutOfMemoryError
from engine.formats.layout import ALIGN, ExpertLayout
from engine.store.host_store import ExpertStore
from tests.engine.cache_helpers import (
    NUM_EXPERTS,
    NUM_LAYERS,
    SHAPES,
    ManualTransfer,
    counters,
    make_cache,
    slot_matches_store,
    use,
)

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


def test_pool_is_n_slots_of_one_expert_each_and_a_zero_row(store, link) -> None:
    cache = make_cache(store, link, n_slots=4)
    assert store.total_experts > 4  # the cache can miss: a row of zeros past the slots
    assert tuple(cache.pool.shape) == (5, store.layout.nbytes)
    assert cache.zero_row == 4 and not cache.pool[4].any()
    assert cache.pool.dtype == torch.uint8
    assert [s.state for s in cache.slots] == [SlotState.FREE] * 4
    assert cache.used_slots == 0 and cache.resident() == []
    for expert in range(4):
        use(cache, (0, expert))
    for slot in cache.slots:  # each slot's views, set with its expert, alias its own row of the pool
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


def test_layers_of_different_layouts_share_slots_of_the_widest(link) -> None:
    """A GGUF file may quantize layers differently: each layer's experts are copied and viewed
    with its own layout, in slots as wide as the widest."""
    narrow = ExpertLayout.from_shapes({"down_proj": (4, 8)}, torch.float16)
    wide = ExpertLayout.from_shapes({"down_proj": (4, 8)}, torch.float32)
    layers = {
        0: torch.randint(0, 255, (2, narrow.nbytes), dtype=torch.uint8),
        1: torch.randint(0, 255, (2, wide.nbytes), dtype=torch.uint8),
    }
    store = ExpertStore(wide, layers, num_experts=2, layer_layouts={0: narrow, 1: wide})
    assert store.expert_nbytes == wide.nbytes and store.nbytes == 2 * (narrow.nbytes + wide.nbytes)
    cache = make_cache(store, link, n_slots=1)  # one slot, used by both layers in turn
    for key in [(0, 1), (1, 0), (0, 0)]:
        slot = cache.acquire(key)
        views = cache.wait(slot)
        assert views["down_proj"].dtype == store.layout_of(key[0]).fields[0].dtype
        assert torch.equal(
            views["down_proj"].view(torch.uint8), store.views(*key)["down_proj"].view(torch.uint8)
        )
        cache.release(slot)
    assert cache.stats.phases["decode"].bytes_copied == 2 * narrow.nbytes + wide.nbytes


def test_uses_in_place_count_as_the_acquires_would_and_map_each_expert_once(store, link) -> None:
    pinned = ExpertCache(store, store.total_experts, torch.device("cpu"), link, LRUPolicy(), in_place=True)
    bulk = ExpertCache(store, store.total_experts, torch.device("cpu"), link, LRUPolicy(), in_place=True)
    for experts in ([0, 3, 5], [3, 1]):
        for expert in experts:
            use(pinned, (1, expert))
        bulk.use_in_place([(1, experts)])
    assert counters(bulk) == counters(pinned) == (5, 0, 0, 0)
    assert bulk.used_slots == pinned.used_slots == 4
    assert sorted(bulk.resident()) == sorted(pinned.resident())
    assert all(slot.pins == 0 for slot in bulk.slots)
    every = list(range(store.num_experts))
    bulk.use_in_place([(1, every)])  # the layer all mapped: its uses are counted, nothing mapped
    bulk.use_in_place([(1, [2, 0])])
    assert counters(bulk) == (5 + store.num_experts + 2, 0, 0, 0)
    assert bulk.used_slots == store.num_experts
    bulk.clear()  # forgotten: the next use maps its expert again
    bulk.use_in_place([(1, [2])])
    assert bulk.used_slots == 1 and bulk.resident() == [(1, 2)]
    with pytest.raises(RuntimeError, match="in-place cache"):
        make_cache(store, link, n_slots=4).use_in_place([(1, [0])])
