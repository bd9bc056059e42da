"""A small table the host writes and the device reads: a MoE layer's slot table between graph pieces.

Contract: `MappedTable(size, device)` holds `size` int64 entries; `device_view` is what kernels and
captured graphs read (the same tensor for the table's life); `write(indices, values)` sets entries
from the host before the work that reads them is enqueued; `mapped` says whether the device reads
the host's memory itself. `device_view(host, device)`: any pinned tensor seen that way.

On CUDA the table lives in pinned host memory. Under unified virtual addressing a kernel can read
pinned memory where it lies, so `device_view` is that memory seen as a CUDA tensor (handed to torch
through `__cuda_array_interface__`, as CuPy and Numba hand theirs) and a write is a store on the
host: nothing launched, nothing copied (engine.decode.piecewise_step: one host synchronisation a
layer and no other host-to-device work between a layer's routes and its experts). Where that view
cannot be made, or a probe reads other values through it, the device keeps its own copy and a
write is one asynchronous copy of the whole table from the pinned memory (`size` · 8 bytes). Off
CUDA the device reads the host tensor itself.

Ordering is the caller's: a layer's table is written after the host has read that layer's routes
(the stream has then run everything before them, including the previous token's reads of it)
and before the work that reads it is enqueued.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


class MappedTable:
    def __init__(self, size: int, device: torch.device):
        cuda = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=cuda)
        self._entries = self._host.numpy()  # writes without a torch dispatch
        view = _mapped_view(self._host, device) if cuda else self._host
        self.mapped = view is not None
        self.device_view = view if view is not None else torch.zeros(size, dtype=torch.int64, device=device)

    def write(self, indices: Sequence[int], values: Sequence[int]) -> None:
        self._entries[list(indices)] = list(values)
        if not self.mapped:
            self.device_view.copy_(self._host, non_blocking=True)


class _CudaArray:
    """`__cuda_array_interface__` (version 3) over a pinned host tensor's memory."""

    def __init__(self, host: torch.Tensor):
        self.host = host  # kept alive by the view torch makes of it
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": host.numpy().dtype.str,
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A contiguous pinned `host` tensor as a tensor on CUDA `device` whose kernels read and write
    its memory where it lies (zero-copy over the link), or None where this device cannot (why:
    logged). The prepared GPU check times a kernel's reads through such a view."""
    try:
        view = torch.as_tensor(_CudaArray(host), device=device)
    except (RuntimeError, TypeError, ValueError) as err:
        log.info("Pinned memory cannot be mapped on %s: %s", device, err)
        return None
    return view if view.device == device else None


def _mapped_view(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """`device_view` of the table, checked by reading a pattern written on the host through it."""
    view = device_view(host, device)
    if view is None:
        log.info("Slot tables are copied to the device")
        return None
    try:
        host.copy_(torch.arange(host.numel(), dtype=torch.int64))
        same = torch.equal(view.cpu(), host)
    finally:
        host.zero_()
    if not same:
        log.info("Slot tables are copied to the device: a mapped read differed from the host's values")
        return None
    return view
