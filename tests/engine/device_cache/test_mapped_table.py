"""engine.device_cache.mapped_table off CUDA: the device reads the host's table itself, and a write
sets only the entries named (tests/engine/cuda reads a mapped one from a replayed graph)."""

from __future__ import annotations

import pytest
import torch

from engine.device_cache.mapped_table import MappedTable, device_view


def test_a_write_sets_the_entries_named_and_the_view_reads_them():
    table = MappedTable(6, torch.device("cpu"))
    view = table.device_view
    assert table.mapped and view.tolist() == [0] * 6
    table.write([4, 1], [7, 3])
    table.write([], [])
    assert view.tolist() == [0, 3, 0, 0, 7, 0]
    assert table.device_view is view  # what a captured graph reads stays the same tensor


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests map it")
def test_without_cuda_a_device_view_is_declined_not_an_error():
    assert device_view(torch.zeros(4, dtype=torch.float32), torch.device("cuda")) is None
