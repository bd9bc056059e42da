"""A hand-made expert store and cache helpers for the cache tests (no model needed)."""

from __future__ import annotations

import torch

from engine.device_cache.eviction import EvictionPolicy, ExpertKey, LRUPolicy
from engine.device_cache.expert_cache import ExpertCache, Slot
from engine.device_cache.transfer import CopyHandle, TransferEngine
from engine.formats.layout import ExpertLayout
from engine.store.host_store import ExpertStore

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

    def synchronize(self) -> None:
        self.land()

    def done(self) -> bool:
        return self.landed


class StreamWaitCopy(ManualCopy):
    """A copy as CUDA's: `wait()` only queues a stream wait (nothing lands on the host's side);
    only `synchronize()` blocks until it lands. `done()` calls are counted: a host loop that polls
    it instead of blocking shows up as thousands of calls."""

    polls = 0

    def wait(self) -> None:
        pass

    def done(self) -> bool:
        StreamWaitCopy.polls += 1
        if StreamWaitCopy.polls > 10_000:
            raise AssertionError("the host spins on done() instead of blocking on the copy")
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


class StreamWaitTransfer(ManualTransfer):
    def copy(self, dst, src, after=None) -> ManualCopy:
        handle = StreamWaitCopy(dst, src, after)
        self.copies.append(handle)
        return handle


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
