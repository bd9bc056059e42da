"""The pinned staging ring: a big expert store stays pageable on CUDA and each copy passes
through one of a few pinned buffers, never reused before the copy reading it has landed.

Run on the CPU with unpinned buffers and copies that land only when asked, as the CUDA copy
stream's do (engine.offload.transfer's `_CudaCopy`); test_gpu.py runs the real thing."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.offload.staging import StagingRing, pinned_if_small
from tests.engine.cache_helpers import make_store


class LateCopy:
    """A device copy from a staging buffer that lands (reads the buffer) only when synchronized."""

    def __init__(self, dst: torch.Tensor, staged: torch.Tensor, log: list):
        self.dst, self.staged, self.log = dst, staged, log
        self.landed = False

    def synchronize(self) -> None:
        if not self.landed:
            self.dst.copy_(self.staged)
            self.landed = True
            self.log.append(("landed", self))


def test_each_copy_lands_the_bytes_it_was_given_though_buffers_are_reused():
    ring = StagingRing(slots=2, nbytes=64, pin=False)
    log: list = []
    sources = [torch.full((48,), value, dtype=torch.uint8) for value in range(1, 6)]
    targets = [torch.zeros(48, dtype=torch.uint8) for _ in sources]
    copies = [
        ring.stage(src, lambda staged, dst=dst: LateCopy(dst, staged, log))
        for src, dst in zip(sources, targets, strict=True)
    ]
    for copy in copies:
        copy.synchronize()
    for src, dst in zip(sources, targets, strict=True):
        assert torch.equal(src, dst)  # no copy read a buffer a later one had overwritten
    # the third copy took the first buffer again: the first copy had to land before it
    assert log.index(("landed", copies[0])) < 2 and ring.nbytes == 128


def test_a_copy_wider_than_a_buffer_is_refused():
    ring = StagingRing(slots=2, nbytes=16, pin=False)
    with pytest.raises(ValueError, match="does not fit"):
        ring.stage(torch.zeros(17, dtype=torch.uint8), lambda staged: None)


def test_copies_from_two_threads_never_share_a_buffer_in_flight():
    ring = StagingRing(slots=3, nbytes=32, pin=False)
    log: list = []
    results: list[tuple[torch.Tensor, torch.Tensor, LateCopy]] = []
    lock = threading.Lock()

    def worker(base: int) -> None:
        for i in range(50):
            src = torch.full((32,), (base + i) % 256, dtype=torch.uint8)
            dst = torch.zeros(32, dtype=torch.uint8)
            copy = ring.stage(src, lambda staged, dst=dst: LateCopy(dst, staged, log))
            with lock:
                results.append((src, dst, copy))

    threads = [threading.Thread(target=worker, args=(base,)) for base in (0, 100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for src, dst, copy in results:
        copy.synchronize()
        assert torch.equal(src, dst)


def test_a_store_is_pinned_whole_only_under_the_limit():
    store = make_store()
    assert pinned_if_small(store, limit=store.nbytes - 1) is store  # too big: stays pageable
    if not torch.cuda.is_available():
        return  # pinning needs CUDA; the GPU tests run the rest
    pinned = pinned_if_small(store, limit=store.nbytes)
    assert pinned.pinned and torch.equal(pinned.buffer(0, 1), store.buffer(0, 1))
