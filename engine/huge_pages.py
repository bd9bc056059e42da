"""Weights the CPU reads every token, on 2 MiB pages (Linux transparent huge pages).

A CPU decode step streams each resident matrix and each chosen expert once, hundreds of MiB a
token. On 4 KiB pages that is a TLB miss every 4 KiB, on 2 MiB pages one every 2 MiB, and a
decode step takes less time. llama.cpp maps its file on the page cache's 4 KiB pages.

Contract: `advise(tensor)`, called after the memory is allocated and before it is written, asks
the kernel to back the 2 MiB-aligned part of it with huge pages as it is first written, and moves
onto huge pages what of it the allocator had already handed out and taken back (memory below
glibc's mmap threshold comes from the heap, on the small pages it was first written on;
MADV_COLLAPSE, Linux 6.1). Best effort and silent: nothing on other systems, where the kernel's
THP setting is "never", or for memory too small to hold one whole huge page; a page the kernel
cannot find whole stays a small one. `backed_bytes(tensor)` is how much of it huge pages hold
(/proc/self/smaps), for tests; `backed_bytes()` the whole process's, for the bench.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux, every architecture
_MADV_COLLAPSE = 25  # Linux 6.1; EINVAL before, and where none of the range was written yet


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _aligned_span(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the whole huge pages inside `tensor`'s memory (empty when there is none)."""
    first = tensor.data_ptr()
    last = first + tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    start = -(-first // HUGE_PAGE) * HUGE_PAGE
    end = last // HUGE_PAGE * HUGE_PAGE
    return start, max(start, end)


def advise(tensor: torch.Tensor) -> None:
    """Ask for huge pages under `tensor`'s host memory, before it is written (see the module).
    Not for pinned memory, which stays on the pages it was locked on (not asked of the tensor:
    `is_pinned` may start a CUDA context)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return
    start, end = _aligned_span(tensor)
    if end > start:  # EINVAL where THP is off: the small pages stay
        madvise(start, end - start, _MADV_HUGEPAGE)
        madvise(start, end - start, _MADV_COLLAPSE)  # what the heap handed back, written before


def backed_bytes(tensor: torch.Tensor | None = None) -> int:
    """Bytes of `tensor`'s memory, or of the whole process's when None, that huge pages hold (0
    where /proc/self/smaps does not say). A mapping is counted whole: exact for memory `advise`d
    alone, since advice splits the mapping at its bounds."""
    start, end = _aligned_span(tensor) if tensor is not None else (0, 1 << 64)
    if end <= start:
        return 0
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    backed, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if not head.endswith(":"):  # a mapping's first line: "lo-hi perms offset ..."
            lo, hi = (int(part, 16) for part in head.split("-"))
            inside = lo < end and start < hi
        elif inside and head == "AnonHugePages:":
            backed += int(line.split()[1]) * 1024
    return min(backed, end - start)
