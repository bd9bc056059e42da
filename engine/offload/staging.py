"""Host memory for the link without pinning every expert.

Pinning a multi-GB expert store fails on ordinary PCs (the OS refuses to lock that much RAM;
llama.cpp's users meet the same). So on CUDA the store is pinned whole only when it is small
(`PIN_WHOLE_LIMIT`, and only if the pin succeeds); otherwise it stays in pageable memory and each
copy passes through a `StagingRing`: a few pinned buffers, each one expert wide. A copy takes the
next buffer (waiting, on the host, until that buffer's previous copy has landed), memcpy's the
expert into it and starts the asynchronous host→device copy from it. The link then sees pinned
memory as before, at the cost of one host memcpy per copy; the pinned memory is
`slots × expert bytes` (a few MiB) instead of the whole store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from engine.offload.expert_store import ExpertStore

log = logging.getLogger(__name__)

PIN_WHOLE_LIMIT = 2 * 2**30  # a store up to this size is pinned whole (when the OS lets us)
STAGING_SLOTS = 6  # buffers in flight: the copies the cache's STREAM_DEPTH and a prefetch keep going


class StagingRing:
    """`slots` pinned buffers of `nbytes`, reused in turn for host→device copies."""

    def __init__(self, slots: int, nbytes: int, pin: bool = True):
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self._in_flight: list[object | None] = [None] * slots  # the copy last started from each
        self._next = 0
        self._lock = threading.Lock()  # the compute thread and the prefetch worker both copy

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() for buf in self.buffers)

    def stage(self, src: torch.Tensor, start: Callable[[torch.Tensor], object]) -> object:
        """Copy `src` (host, uint8) into the next buffer and `start(buffer)` the device copy from it;
        returns what `start` returns (a handle with `synchronize()`), kept to guard the buffer."""
        nbytes = src.numel()
        with self._lock:
            index = self._next
            self._next = (index + 1) % len(self.buffers)
            previous = self._in_flight[index]
            if previous is not None:
                previous.synchronize()  # that copy still reads this buffer: wait until it landed
            buffer = self.buffers[index][:nbytes]
            if nbytes > buffer.numel():
                raise ValueError(f"a {nbytes}-byte copy does not fit a {buffer.numel()}-byte staging buffer")
            buffer.copy_(src)
            handle = start(buffer)
            self._in_flight[index] = handle
            return handle


def pinned_if_small(store: ExpertStore, limit: int | None = None) -> ExpertStore:
    """`store` with its layers in pinned memory when it is at most `limit` bytes (default
    `PIN_WHOLE_LIMIT`) and the OS lets us pin them; else `store` itself (copies are staged)."""
    limit = PIN_WHOLE_LIMIT if limit is None else limit
    if store.pinned or store.nbytes > limit:
        return store
    try:
        layers = {layer: store.layer_buffer(layer).pin_memory() for layer in store.layer_indices}
    except RuntimeError as err:  # the OS would not lock that much memory
        gib = store.nbytes / 2**30
        log.info("Could not pin the %.1f GiB expert store (%s): copies are staged.", gib, err)
        return store
    layouts = {layer: store.layout_of(layer) for layer in store.layer_indices}
    return ExpertStore(store.layout, layers, store.num_experts, layouts)
