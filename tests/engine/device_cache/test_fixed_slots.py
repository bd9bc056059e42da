"""A cache with a slot for every expert (`engine.device_cache.fixed_slots`): filled whole, each layer's
experts in a slot table on the device, uses counted as hits without pinning."""

from __future__ import annotations

import pytest
import torch

from engine.device_cache.expert_cache import SlotState
from tests.engine.cache_helpers import (
    NUM_EXPERTS,
    NUM_LAYERS,
    ManualTransfer,
    StreamWaitTransfer,
    counters,
    make_cache,
    slot_matches_store,
    use,
)


def test_fill_copies_each_missing_expert_once_in_the_load_phase(store) -> None:
    transfer = ManualTransfer()
    cache = make_cache(store, transfer, n_slots=store.total_experts)
    assert cache.holds_all
    use(cache, (1, 2))  # already cached: not copied again
    assert cache.fill() == store.total_experts - 1
    assert counters(cache, "load") == (
        0,
        store.total_experts - 1,
        (store.total_experts - 1) * store.layout.nbytes,
        store.total_experts - 1,
    )
    assert counters(cache) == (0, 1, store.layout.nbytes, 1)
    assert all(copy.landed for copy in transfer.copies)
    assert all(s.state is SlotState.READY and s.pins == 0 for s in cache.slots)
    assert all(slot_matches_store(cache, s) for s in cache.slots)
    assert cache.fill() == 0  # nothing left to bring in


def test_fill_goes_a_layer_at_a_time_and_reports_each_once_it_landed(store) -> None:
    """As on CUDA, a consumer's wait only orders the compute stream (`StreamWaitTransfer`): the
    fill blocks on each layer's last copy (one link, in order) before it reports the layer."""
    transfer = StreamWaitTransfer()
    cache = make_cache(store, transfer, n_slots=store.total_experts)
    reports = []

    def progress(done: int, total: int) -> None:
        reports.append((done, total, len(transfer.copies), transfer.copies[-1].landed))

    assert cache.fill(progress) == store.total_experts
    assert reports == [(i, NUM_LAYERS, i * NUM_EXPERTS, True) for i in range(1, NUM_LAYERS + 1)]


def test_a_cache_smaller_than_the_model_is_neither_filled_nor_given_tables(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=store.total_experts - 1)
    assert not cache.holds_all
    assert cache.fill() == 0 and cache.used_slots == 0
    for expert in range(NUM_EXPERTS):
        use(cache, (0, expert))  # the whole layer is in, and still no table: it could be evicted
    assert cache.slot_table(0) is None


def test_a_layers_table_comes_once_every_expert_of_it_has_landed(store) -> None:
    transfer = ManualTransfer()
    cache = make_cache(store, transfer, n_slots=store.total_experts)
    for expert in range(NUM_EXPERTS - 1):
        use(cache, (0, expert))
    assert cache.slot_table(0) is None  # one expert missing
    slot = cache.acquire((0, NUM_EXPERTS - 1))
    assert cache.slot_table(0) is None  # its copy has not landed
    cache.wait(slot)
    cache.release(slot)
    table = cache.slot_table(0)
    assert table.tolist() == [cache._table[(0, e)].index for e in range(NUM_EXPERTS)]
    for expert, index in enumerate(table.tolist()):
        assert torch.equal(cache.pool[index], store.buffer(0, expert))
    assert cache.slot_table(0) is table  # kept, not rebuilt each step
    assert cache.slot_table(1) is None  # another layer, not in yet


def test_tables_are_dropped_when_their_experts_leave(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=store.total_experts)
    cache.fill()
    assert all(cache.slot_table(layer) is not None for layer in range(NUM_LAYERS))
    cache.clear()
    assert all(cache.slot_table(layer) is None for layer in range(NUM_LAYERS))
    cache.fill()
    cache.resize(store.total_experts - 1)  # after an out-of-memory: no longer holds all
    assert cache.slot_table(0) is None and cache.fill() == 0


def test_hits_through_a_table_count_in_the_phase_without_pinning(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=store.total_experts)
    cache.fill()
    cache.count_hits(3)
    with cache.in_phase("verify"):
        cache.count_hits(2)
    assert counters(cache)[:2] == (3, 0) and counters(cache, "verify")[:2] == (2, 0)
    assert all(s.pins == 0 for s in cache.slots)


def test_a_failed_copy_fails_the_fill_leaves_nothing_pinned_and_no_table(store) -> None:
    class FailingTransfer(ManualTransfer):
        def copy(self, dst, src, after=None):
            handle = super().copy(dst, src, after)
            if len(self.copies) == 5:
                handle.land = lambda: (_ for _ in ()).throw(RuntimeError("link lost"))
            return handle

    cache = make_cache(store, FailingTransfer(), n_slots=store.total_experts)
    with pytest.raises(RuntimeError, match="link lost"):
        cache.fill()
    assert all(s.pins == 0 for s in cache.slots)
    assert cache.slot_table(0) is None  # the failed expert is not cached
    assert cache.used_slots == NUM_EXPERTS - 1  # its layer's others; later layers were not started
