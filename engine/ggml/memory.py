"""Where the engine's ggml tensors lie: ggml's own memory regions and a buffer over the rest.

Contract: `own(start, end, buffer)` / `disown(start)` record and forget memory ggml allocated
itself (llama.cpp's interleaved rows, engine.ggml.interleave), `owned_buffer(address)` is
(end, buffer) of the region an address lies in; `buffer_of(ggml, memory)` is the buffer a tensor
over `memory` is bound through — that region's, whose type tells ggml how to compute on it, else
`everywhere(ggml)`, a CPU buffer over the whole address space that owns nothing; `bind(ggml,
tensor, buffer, address)` places a tensor there.
"""

from __future__ import annotations

import bisect
import functools

import torch

from engine.ggml.library import Ggml

_ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT

# Memory ggml allocated itself, such as llama.cpp's interleaved rows (engine.ggml.interleave):
# a tensor there is bound to that buffer, whose type tells ggml how to compute on it, not to a plain
# buffer over the pointer. Looked up on every bind, so by bisection over the regions' starts.
_owned_starts: list[int] = []  # sorted
_owned: dict[int, tuple[int, int]] = {}  # start address -> (end address, buffer)


def own(start: int, end: int, buffer: int) -> None:
    """Record that ggml's `buffer` holds the memory [start, end)."""
    bisect.insort(_owned_starts, start)
    _owned[start] = (end, buffer)


def disown(start: int) -> None:
    """Forget the region `own` recorded at `start` (its buffer is being freed)."""
    if _owned.pop(start, None) is not None:
        del _owned_starts[bisect.bisect_left(_owned_starts, start)]


def owned_buffer(address: int) -> tuple[int, int] | None:
    """(end address, buffer) of the ggml-allocated memory `address` lies in, if any."""
    index = bisect.bisect_right(_owned_starts, address) - 1
    if index < 0:
        return None
    end, buffer = _owned[_owned_starts[index]]
    return (end, buffer) if address < end else None


_ADDRESS_SPACE = 1 << 47  # x86-64 and arm64 user addresses lie below


@functools.cache
def everywhere(ggml: Ggml) -> int:
    """A CPU buffer from the first aligned address to the end of user memory: a tensor bound to it
    may lie anywhere; it owns no memory and lives as long as the process."""
    buffer = ggml.cpu_buffer_from_ptr(_ALIGNMENT, _ADDRESS_SPACE - _ALIGNMENT)
    if not buffer:
        raise RuntimeError("ggml could not make a CPU buffer over the address space")
    return buffer


def buffer_of(ggml: Ggml, memory: torch.Tensor) -> int:
    """The buffer `memory` is bound through: ggml's own where ggml allocated it, else `everywhere`."""
    if _owned and (owner := owned_buffer(memory.data_ptr())) is not None:
        return owner[1]
    return everywhere(ggml)


def bind(ggml: Ggml, tensor: int, buffer: int, address: int) -> None:
    """Place `tensor` at `address` in `buffer` (ggml's check of the bounds, as an error)."""
    if ggml.tensor_alloc(buffer, tensor, address) != 0:
        raise RuntimeError("ggml could not bind a tensor to its memory")
