"""The pinned staging ring: a big expert store stays pageable on CUDA and each copy passes
through one of a few pinned buffers, never reused before the copy reading it has landed.

Run on the CPU with unpinned buffers and copies that land only when asked, as the CUDA copy
stream's do (engine.device_cache.transfer's `_CudaCopy`); test_gpu.py runs the real thing."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from engine.store.staging import REGISTER_RAM_SHARE, StagingRing, pinned_for_copies, register_in_place
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


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister as the driver answers them, refusing the `refuse`-th
    registration (counting from 1); what is registered is kept by address."""

    def __init__(self, refuse: int | None = None):
        self.refuse, self.calls = refuse, 0
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls += 1
        if self.calls == self.refuse:
            return 2  # cudaErrorMemoryAllocation
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        del self.registered[address]
        return 0


def test_a_store_is_pinned_whole_only_under_the_limit(monkeypatch):
    store = make_store()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(refuse=1))  # nor in place
    assert pinned_for_copies(store, limit=store.nbytes - 1) is store  # too big: stays pageable
    if not torch.cuda.is_available():
        return  # pinning needs CUDA; the GPU tests run the rest
    pinned = pinned_for_copies(store, limit=store.nbytes)
    assert pinned.pinned and torch.equal(pinned.buffer(0, 1), store.buffer(0, 1))


def test_a_bigger_store_is_pinned_in_place_while_it_leaves_the_rest_of_the_ram(monkeypatch):
    store = make_store()
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    ram = int(store.nbytes / REGISTER_RAM_SHARE)
    assert pinned_for_copies(store, limit=0, ram_bytes=ram) is store  # the same buffers, no copy
    buffers = [store.layer_buffer(layer) for layer in store.layer_indices]
    assert cudart.registered == {buf.data_ptr(): buf.nbytes for buf in buffers}
    del store, buffers
    gc.collect()
    assert cudart.registered == {}, "a freed buffer is unpinned"


def test_a_store_over_the_ram_share_is_left_pageable(monkeypatch):
    store = make_store()
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    assert pinned_for_copies(store, limit=0, ram_bytes=int(store.nbytes / REGISTER_RAM_SHARE) - 1) is store
    assert cudart.calls == 0


def test_a_refused_registration_leaves_nothing_pinned(monkeypatch):
    store = make_store()
    cudart = FakeCudart(refuse=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buffers = [store.layer_buffer(layer) for layer in store.layer_indices]
    assert len(buffers) > 2
    assert not register_in_place(buffers)
    assert cudart.calls == 2 and cudart.registered == {}
