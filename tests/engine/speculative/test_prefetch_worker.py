"""`PrefetchWorker` (SP-MoE Alg. 2): a stand-in cache shows what it issues, in what order and
under which lock; one test runs it against a real cache over a simulated link."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from engine.device_cache.transfer import SimulatedLink
from engine.speculative.prefetch import PrefetchWorker
from tests.engine.cache_helpers import make_cache, make_store
from tests.engine.conftest import prefetch_threads


class StandInCache:
    """What the worker needs of an ExpertCache: a lock, `prefetch` and `in`."""

    def __init__(self, refuse=(), fail=()):
        self.lock = threading.RLock()
        self.issued: list[tuple[tuple[int, int], str]] = []
        self.resident: set[tuple[int, int]] = set()
        self.refuse, self.fail = set(refuse), set(fail)
        self.started = threading.Event()
        self.gate = threading.Event()  # prefetch waits on it; set unless a test holds the worker
        self.gate.set()

    def prefetch(self, key, phase=None, spare_only=False) -> bool:
        self.started.set()
        assert self.gate.wait(5)
        if key in self.fail:
            raise RuntimeError("copy failed")
        if key in self.refuse or key in self.resident:
            return False
        self.issued.append((key, phase))
        self.resident.add(key)
        return True

    def __contains__(self, key) -> bool:
        return key in self.resident


@pytest.fixture
def stand_in(no_worker_left):
    cache = StandInCache()
    worker = PrefetchWorker(cache)
    yield cache, worker
    cache.gate.set()
    worker.close()


def test_the_worker_issues_each_task_under_the_cache_lock(stand_in):
    cache, worker = stand_in
    with cache.lock:  # compute holds the lock: the batch waits for it
        worker.submit([(0, 1), (0, 2)], "draft")
        worker.submit([(1, 3)], "verify")
        time.sleep(0.05)
        assert cache.issued == []
    worker.drain()
    assert cache.issued == [((0, 1), "draft"), ((0, 2), "draft"), ((1, 3), "verify")]


def test_an_empty_task_is_not_queued(stand_in):
    cache, worker = stand_in
    worker.submit([], "draft")
    worker.submit(iter(()), "draft")
    worker.drain()
    assert cache.issued == [] and not cache.started.is_set()


def test_a_task_stops_at_the_first_key_no_slot_can_take(stand_in):
    cache, worker = stand_in
    cache.resident.add((0, 2))  # already cached: skipped, the task goes on
    cache.refuse.add((0, 4))  # refused and not cached: every slot is busy, the task ends
    worker.submit([(0, 1), (0, 2), (0, 3), (0, 4), (0, 5)], "draft")
    worker.drain()
    assert [key for key, _ in cache.issued] == [(0, 1), (0, 3)]


def test_discard_pending_drops_the_tasks_not_started(stand_in):
    cache, worker = stand_in
    cache.gate.clear()
    worker.submit([(0, 1)], "draft")
    assert cache.started.wait(5)  # the worker is inside the first task
    worker.submit([(0, 2)], "draft")
    worker.submit([(0, 3)], "draft")
    worker.discard_pending()
    cache.gate.set()
    worker.drain()
    assert cache.issued == [((0, 1), "draft")]


def test_a_failing_task_is_logged_and_the_worker_goes_on(stand_in, caplog):
    cache, worker = stand_in
    cache.fail.add((0, 1))
    with caplog.at_level(logging.ERROR, logger="engine.speculative.prefetch"):
        worker.submit([(0, 1), (0, 2)], "draft")
        worker.submit([(0, 3)], "draft")
        worker.drain()
    assert "Prefetch task failed" in caplog.text
    assert cache.issued == [((0, 3), "draft")]


def test_close_drops_queued_tasks_and_joins_the_thread(no_worker_left):
    cache = StandInCache()
    before = set(prefetch_threads())
    worker = PrefetchWorker(cache)
    (thread,) = set(prefetch_threads()) - before
    cache.gate.clear()
    worker.submit([(0, 1)], "draft")
    assert cache.started.wait(5)
    for expert in range(2, 6):
        worker.submit([(0, expert)], "draft")
    threading.Timer(0.05, cache.gate.set).start()  # the running task ends while close() waits
    worker.close()
    assert not thread.is_alive()
    assert cache.issued == [((0, 1), "draft")]


def test_the_worker_prefetches_into_a_real_cache(no_worker_left):
    link = SimulatedLink(gbps=None)
    cache = make_cache(make_store(), link, n_slots=3)
    worker = PrefetchWorker(cache)
    try:
        worker.submit([(0, 1), (2, 4)], "draft")
        worker.drain()
        assert (0, 1) in cache and (2, 4) in cache
        assert cache.stats.phases["draft"].prefetched == 2
        cache.phase = "verify"
        slot = cache.acquire((0, 1))
        cache.wait(slot)
        cache.release(slot)
        cache.settle_prefetches()
        draft, verify = cache.stats.phases["draft"], cache.stats.phases["verify"]
        assert (draft.prefetch_used, draft.prefetch_wasted) == (1, 1)
        assert (verify.hits, verify.misses, verify.prefetch_hits) == (1, 0, 1)
    finally:
        worker.close()
        link.close()


def test_drain_is_bounded_when_the_worker_is_stuck():
    import threading as _threading

    from engine.speculative.prefetch import PrefetchWorker

    release = _threading.Event()

    class StuckCache:
        lock = _threading.RLock()

        def prefetch(self, key, phase, spare_only=False):
            release.wait(10)  # a copy that does not get issued
            return True

        def __contains__(self, key):
            return False

    worker = PrefetchWorker(StuckCache())
    try:
        worker.submit([(0, 0)], "draft")
        with pytest.raises(TimeoutError, match="did not issue"):
            worker.drain(timeout_s=0.2)
    finally:
        release.set()
        worker.close()
