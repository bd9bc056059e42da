"""Host memory for the link without pinning every expert.

Copies run at the link's speed only from pinned (page-locked) memory. `pinned_for_copies` decides,
on CUDA, where the store's copies come from:
- a small store (`PIN_WHOLE_LIMIT`) is copied into pinned memory whole;
- a bigger one is pinned where it lies (`register_in_place`: cudaHostRegister, no second copy and
  none of the pinned allocator's rounding up to a power of two) while it takes at most
  `REGISTER_RAM_SHARE` of the machine's RAM, so the OS and other programs keep the rest;
- otherwise, or when the OS refuses to lock that much (ordinary PCs may; llama.cpp's users meet
  the same), it stays pageable and each copy passes through a `StagingRing`: a few pinned buffers,
  each one expert wide. A copy takes the next buffer (waiting, on the host, until that buffer's
  previous copy has landed), memcpy's the expert into it and starts the asynchronous host→device
  copy from it: one host memcpy per copy, on the thread that asked for it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence

import psutil
import torch

from engine.store.host_store import ExpertStore

log = logging.getLogger(__name__)

PIN_WHOLE_LIMIT = 2 * 2**30  # a store up to this size is pinned whole (when the OS lets us)
REGISTER_RAM_SHARE = 0.5  # a bigger store is pinned in place while it takes at most this share of RAM
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


def pinned_for_copies(
    store: ExpertStore, limit: int | None = None, ram_bytes: int | None = None
) -> ExpertStore:
    """`store` ready for copies to a CUDA device: copied into pinned memory when it is at most `limit`
    bytes (default `PIN_WHOLE_LIMIT`), else pinned in place when it takes at most `REGISTER_RAM_SHARE`
    of `ram_bytes` (default: this machine's RAM); as it is (pageable: copies are staged) when neither
    applies or the OS refuses."""
    limit = PIN_WHOLE_LIMIT if limit is None else limit
    if store.pinned:
        return store
    gib = store.nbytes / 2**30
    if store.nbytes <= limit:
        try:
            layers = {layer: store.layer_buffer(layer).pin_memory() for layer in store.layer_indices}
        except RuntimeError as err:  # the OS would not lock that much memory
            log.info("Could not pin the %.1f GiB expert store (%s): copies are staged.", gib, err)
            return store
        layouts = {layer: store.layout_of(layer) for layer in store.layer_indices}
        return ExpertStore(store.layout, layers, store.num_experts, layouts)
    ram = psutil.virtual_memory().total if ram_bytes is None else ram_bytes
    if store.nbytes > REGISTER_RAM_SHARE * ram:
        log.info(
            "The %.1f GiB expert store is more than %.0f%% of this machine's %.0f GiB of RAM: it stays "
            "pageable and copies are staged through pinned buffers.",
            gib,
            100 * REGISTER_RAM_SHARE,
            ram / 2**30,
        )
    elif register_in_place([store.layer_buffer(layer) for layer in store.layer_indices]):
        log.info("Pinned the %.1f GiB expert store in place: copies run at the link's speed.", gib)
    else:
        log.info("The OS would not pin the %.1f GiB expert store: copies are staged.", gib)
    return store


def register_in_place(buffers: Sequence[torch.Tensor]) -> bool:
    """Pin each contiguous host buffer where it lies (cudaHostRegister); each is unpinned when its
    tensor is freed. All or none: when the driver refuses one, those already pinned are unpinned and
    the answer is False."""
    cudart = torch.cuda.cudart()
    done: list[weakref.finalize] = []
    for buffer in buffers:
        address = buffer.data_ptr()
        error = cudart.cudaHostRegister(address, buffer.numel() * buffer.element_size(), 0)
        if int(error) != 0:
            log.debug("cudaHostRegister refused %d bytes (error %d)", buffer.nbytes, int(error))
            for unpin in done:
                unpin()
            return False
        done.append(weakref.finalize(buffer, cudart.cudaHostUnregister, address))
    return True
