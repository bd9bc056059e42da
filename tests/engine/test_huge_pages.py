"""Weights on 2 MiB pages: advised memory is backed by huge pages once written, the rest is not.

Linux only, and only where the kernel's transparent huge pages are "madvise" or "always"."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from engine import huge_pages
from engine.ggml import interleave as ggml_interleave
from engine.ggml import library as ggml_library
from engine.store.host_store import allocate_layer

_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    if not sys.platform.startswith("linux") or not _SETTING.exists():
        return None
    text = _SETTING.read_text()
    return text[text.index("[") + 1 : text.index("]")]


needs_thp = pytest.mark.skipif(
    _thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here"
)
MiB = 1 << 20


@needs_thp
def test_advised_memory_is_on_huge_pages_once_written():
    memory = torch.empty(16 * MiB, dtype=torch.uint8)
    huge_pages.advise(memory)
    memory.fill_(1)
    assert huge_pages.backed_bytes(memory) >= 8 * MiB  # of its 7 or 8 whole huge pages
    assert huge_pages.backed_bytes() >= huge_pages.backed_bytes(memory)


def _fresh_mapping(nbytes: int) -> torch.Tensor:
    """Memory of a mapping of its own: no advice another test gave the heap applies to it."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only 'madvise' gives small pages unadvised")
def test_memory_not_advised_stays_on_small_pages():
    memory = _fresh_mapping(16 * MiB)
    memory.fill_(1)
    assert huge_pages.backed_bytes(memory) == 0
    advised = _fresh_mapping(16 * MiB)
    huge_pages.advise(advised)
    advised.fill_(1)
    assert huge_pages.backed_bytes(advised) >= 8 * MiB


@needs_thp
def test_an_expert_layer_in_host_memory_lies_on_huge_pages():
    packed = allocate_layer(8, 2 * MiB, pin=False, layer=0)
    packed.fill_(3)
    assert huge_pages.backed_bytes(packed) >= 8 * MiB
    assert bool((packed == 3).all())


def test_memory_without_a_whole_huge_page_is_left_alone():
    small = torch.ones(MiB, dtype=torch.uint8)
    huge_pages.advise(small)  # no whole 2 MiB page inside: nothing to ask, nothing fails
    assert huge_pages.backed_bytes(small) == 0
    assert bool((small == 1).all())
    huge_pages.advise(torch.empty(0))


@needs_thp
@pytest.mark.skipif(not ggml_library.available()[0], reason="llama-cpp-python is not installed")
def test_ggml_interleaving_memory_lies_on_huge_pages():
    if ggml_interleave._repack_type() is None:
        pytest.skip("this ggml has no interleaving CPU buffers")
    memory = ggml_interleave.allocate(16 * MiB, "a test")
    memory.fill_(5)
    assert huge_pages.backed_bytes(memory) >= 8 * MiB


@needs_thp
def test_memory_the_heap_hands_back_is_moved_onto_huge_pages():
    for _ in range(2):  # memory below glibc's mmap threshold, written on small pages, then freed
        written = [torch.ones(24 * MiB, dtype=torch.uint8) for _ in range(4)]
        del written
        torch.ones(40 * MiB, dtype=torch.uint8)  # raises the threshold past the sizes above
    memory = torch.empty(16 * MiB, dtype=torch.uint8)
    huge_pages.advise(memory)
    memory.fill_(1)
    assert huge_pages.backed_bytes(memory) >= 8 * MiB
