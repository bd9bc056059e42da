"""llama.cpp's interleaved weight rows for the CPU (its `CPU_REPACK` buffers), for weights used in place.

Contract: `interleaves(ggml_type, rows)` says whether ggml's CPU backend has, on this CPU, a form of
a `rows`-row weight of that type with 8 rows interleaved block by block (on AVX2: Q4_0, Q4_K,
IQ4_NL, MXFP4; ggml's own rule, asked of ggml); `allocate(nbytes)` is uint8 host memory in such a
buffer (ggml's, freed when the last tensor over it goes); `interleave_into(target, blocks,
ggml_type, out, in)` writes one `[out, in]` weight, given in the file's row layout, into `target`
inside that memory in the interleaved form. `engine.ggml.kernels` binds a weight lying there to its
buffer, so ggml multiplies it with the kernels llama.cpp itself uses for the same file on this
CPU: one pass over an activation block serves 8 rows, which makes a decode step's routed products
faster.

Values: the same integer dot products, scaled and summed in another order than the row-by-row
kernel's, so products agree to float32 rounding (~1e-6 relative), not bit for bit. `ggml_mul_mat_id`
computes every route on its own row whatever the number of tokens, so a batch's products equal
one-token products. A plain `ggml_mul_mat` on such memory takes 4-row kernels from 4 tokens on; a
model's resident matrices of these types are interleaved too (engine.resident.ggml_linear, as
llama.cpp's CPU_REPACK buffers hold them), so
a batch of 4 or more rows through them rounds differently from one-token rows (~1e-6 relative),
as llama.cpp's batches do.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine import huge_pages
from engine.errors import DeviceOutOfMemoryError
from engine.ggml import kernels as ggml_kernels
from engine.ggml import memory as ggml_memory
from engine.ggml.graphs import Tensor, readable
from engine.ggml.library import library

_P = ctypes.c_void_p


@functools.cache
def _repack_type() -> int | None:
    """ggml's `CPU_REPACK` buffer type, where this ggml has it and its tensors read as `Tensor`."""
    ggml, _ = library()
    if ggml is None or not readable(ggml):
        return None  # another ggml.h than this module was written against: the plain kernels
    reg = ggml.cpu_reg()
    address = ggml.reg_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return None
    types = ctypes.CFUNCTYPE(ctypes.POINTER(_P), _P)(address)(ggml.reg_dev_get(reg, 0))
    index = 0
    while types[index]:
        if ggml.buft_name(types[index]) == b"CPU_REPACK":
            return types[index]
        index += 1
    return None


@functools.cache
def interleaves(ggml_type: int, rows: int) -> bool:
    """Whether ggml interleaves a `rows`-row weight of `ggml_type` on this CPU: a probe tensor of
    that type and height is placed in an interleaving buffer, which marks the ones it repacks."""
    buffer_type = _repack_type()
    if buffer_type is None or rows <= 0:
        return False
    ggml, _ = library()
    block_weights, _ = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    buffer = ggml.buft_alloc_buffer(buffer_type, ggml.row_size(ggml_type, block_weights) * rows)
    if not buffer:
        return False
    try:
        context, _ = ggml_kernels._context(ggml)
        tensor = ggml.new_tensor_2d(context, ggml_type, block_weights, rows)
        head = Tensor.from_address(tensor)
        if head.type != ggml_type or list(head.ne) != [block_weights, rows, 1, 1]:
            return False
        return ggml.tensor_alloc(buffer, tensor, ggml.buffer_base(buffer)) == 0 and bool(head.extra)
    finally:
        ggml.buffer_free(buffer)


def allocate(nbytes: int, what: str) -> torch.Tensor:
    """`nbytes` of uint8 host memory in a ggml interleaving buffer (`what` names it in errors)."""
    ggml, _ = library()
    buffer_type = _repack_type()
    if buffer_type is None:
        raise RuntimeError("this ggml has no interleaving CPU buffers")
    buffer = ggml.buft_alloc_buffer(buffer_type, nbytes)
    if not buffer:
        raise DeviceOutOfMemoryError(
            f"Cannot allocate {nbytes / 2**30:.1f} GiB of host memory for {what}. "
            "Close other programs or use a smaller model."
        )
    start = ggml.buffer_base(buffer)
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(start))
    ggml_memory.own(start, start + nbytes, buffer)
    weakref.finalize(array, _free, start, buffer)  # the tensor below keeps `array` alive
    memory = torch.from_numpy(array)
    huge_pages.advise(memory)  # not yet written: ggml's buffers are allocated, not cleared
    return memory


def _free(start: int, buffer: int) -> None:
    ggml_memory.disown(start)
    ggml, _ = library()
    ggml.buffer_free(buffer)


def interleave_into(
    target: torch.Tensor, blocks: torch.Tensor, ggml_type: int, out_features: int, in_features: int
) -> None:
    """Write the `[out, in]` weight whose ggml blocks are `blocks` (uint8, the file's rows) into
    `target`, as many bytes inside `allocate`d memory, with its rows interleaved. Every argument is
    checked here: ggml aborts the process on a failed assertion."""
    ggml, _ = library()
    nbytes = ggml.row_size(ggml_type, in_features) * out_features
    address = target.data_ptr()
    owner = ggml_memory.owned_buffer(address)
    if owner is None or address + nbytes > owner[0]:
        raise ValueError("the target does not lie inside memory from ggml_interleave.allocate")
    if not interleaves(ggml_type, out_features):
        raise ValueError(f"ggml does not interleave a {out_features}-row weight of type {ggml_type}")
    for tensor, name in ((target, "target"), (blocks, "blocks")):
        if tensor.dtype != torch.uint8 or not tensor.is_contiguous() or tensor.numel() != nbytes:
            raise ValueError(f"{name}: {out_features}×{in_features} weights take {nbytes} contiguous bytes")
    context, _ = ggml_kernels._context(ggml)
    weight = ggml.new_tensor_2d(context, ggml_type, in_features, out_features)
    if ggml.tensor_alloc(owner[1], weight, address) != 0:
        raise RuntimeError("ggml could not place a weight in its interleaving buffer")
    ggml.tensor_set(weight, blocks.data_ptr(), 0, nbytes)
