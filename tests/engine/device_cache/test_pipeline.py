"""The copy pipeline of one MoE layer (`engine.device_cache.pipeline.ready_experts`), and the scoped
state around it: `ExpertCache.in_phase` and `ExpertControl.installed` always restore."""

from __future__ import annotations

import pytest

from engine.device_cache.expert_cache import STREAM_DEPTH
from engine.device_cache.pipeline import ready_experts
from engine.errors import BudgetTooSmallError
from engine.moe.control import DraftRouting, ExpertControl
from tests.engine.cache_helpers import (
    NUM_EXPERTS,
    ManualTransfer,
    StreamWaitCopy,
    StreamWaitTransfer,
    make_cache,
)


def test_experts_come_in_order_with_their_slots_released_after_use(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=4)
    seen = []
    for expert, weights in ready_experts(cache, 0, [2, 0, 1]):
        seen.append(expert)
        assert weights.keys() == store.layout.views(cache.pool[0]).keys()
        assert sum(slot.pins for slot in cache.slots) >= 1  # the one being computed is pinned
    assert seen == [2, 0, 1]
    assert all(slot.pins == 0 for slot in cache.slots)


def test_an_error_mid_layer_leaves_no_slot_pinned(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=4)
    experts = ready_experts(cache, 0, [0, 1, 2])
    with pytest.raises(RuntimeError, match="compute failed"):
        for _expert, _weights in experts:
            raise RuntimeError("compute failed")
    experts.close()
    assert all(slot.pins == 0 for slot in cache.slots)


def test_a_layer_needing_more_experts_than_slots_computes_to_free_them(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=2)
    assert [e for e, _ in ready_experts(cache, 0, list(range(NUM_EXPERTS)))] == list(range(NUM_EXPERTS))
    assert cache.stats.phases["decode"].misses == NUM_EXPERTS


def test_every_slot_pinned_by_other_work_is_a_budget_error(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=1)
    cache.acquire((1, 0))  # another layer's compute holds the only slot
    with pytest.raises(BudgetTooSmallError, match="--expert-budget"):
        list(ready_experts(cache, 0, [0]))


def test_a_streaming_step_pins_at_most_stream_depth_misses(store) -> None:
    cache = make_cache(store, ManualTransfer(), n_slots=STREAM_DEPTH + 3)
    most = 0
    for _expert, _weights in ready_experts(cache, 0, list(range(NUM_EXPERTS)), streaming=True):
        most = max(most, sum(slot.pins for slot in cache.slots))
    assert most == STREAM_DEPTH


def test_waiting_for_a_prefetch_to_land_blocks_instead_of_polling(store) -> None:
    """On CUDA a copy's `wait()` only queues a stream wait: a miss that must wait for an in-flight
    prefetch's slot has to block on the copy (`synchronize`), not loop on `done()`."""
    StreamWaitCopy.polls = 0
    cache = make_cache(store, StreamWaitTransfer(), n_slots=1)
    assert cache.prefetch((0, 0))  # in flight, unpinned, the only slot
    assert [e for e, _ in ready_experts(cache, 0, [1])] == [1]
    assert StreamWaitCopy.polls < 10


def test_a_phase_scope_restores_the_phase_however_it_ends(store) -> None:
    cache = make_cache(store, ManualTransfer())
    with pytest.raises(RuntimeError), cache.in_phase("verify"):
        assert cache.phase == "verify"
        raise RuntimeError
    assert cache.phase == "decode"


def test_control_changes_are_undone_however_the_block_ends() -> None:
    control = ExpertControl()
    routing = DraftRouting(top_r=1)
    with pytest.raises(RuntimeError), control.installed(draft=routing, observers=(print,)):
        assert control.draft is routing and control.observers == (print,)
        raise RuntimeError
    assert control.draft is None and control.observers == ()
