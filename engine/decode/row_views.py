"""A graph input that lies in a long-lived table, given by its address (engine.decode.graph_chain).

Contract: `Row.of(table, element, shape)` is `table`'s memory from its `element`-th element on
(counted over the flat contiguous table), read as `shape`: what a kept ggml graph needs of an
input tensor to run (`data_ptr()`) and to be built (`shape`, `numel()`, `is_contiguous()`),
without a tensor being made (`tensor()` makes one). It holds the table, so the memory outlives
the step.

Why: a decode step's token id, rotary angles, cache position and mask are rows of tables that
live as long as the model (a vocabulary's ids, the rotary table, a cache's positions); a view of
a table is costly where the weights streamed through the caches leave the interpreter's cold, and
a step made six.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Row(NamedTuple):
    table: torch.Tensor
    address: int
    shape: tuple[int, ...]

    @classmethod
    def of(cls, table: torch.Tensor, element: int, shape: tuple[int, ...]) -> Row:
        """`shape`'s elements of the contiguous `table` from its `element`-th on."""
        if not table.is_contiguous():
            raise ValueError("a row is read from a contiguous table")
        if not 0 <= element <= table.numel() - math.prod(shape):
            raise IndexError(f"{shape} from element {element} lies outside a table of {table.numel()}")
        return cls(table, table.data_ptr() + element * table.element_size(), shape)

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        return True

    def tensor(self) -> torch.Tensor:
        """The row as a view of its table (for a reader that needs a tensor)."""
        element = (self.address - self.table.data_ptr()) // self.table.element_size()
        return self.table.view(-1)[element : element + self.numel()].view(self.shape)
