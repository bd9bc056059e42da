"""ggml graphs of one-token products kept built between decode steps (engine.ggml.kernels).

Contract: `Tensor` is ggml.h's `struct ggml_tensor` as ctypes reads it, and `readable(ggml)` says
whether this ggml's tensors have that size (another ggml.h: nothing here is used). A `KeptGraph`
is a graph described once in its own metadata context, its weights bound once, and its moving
tensors (activations, indices, outputs: new memory at every call) listed with the argument they
lie in; `compute(backend, memories)` points each moving tensor at this call's memory and runs the
graph, a foreign call where building the graph again took about fifteen. `KeptGraphs` holds a
thread's graphs by key (at most `LIMIT`, the oldest dropped first; `ThreadsKeptGraphs` a smaller
set of each thread's); a graph's context is freed with the graph.

Why: a decode step calls ggml about eleven times on a two-layer model and ~240 times on a 48-layer
one; building a call's graph (tensors, binds, nodes) costs more Python and ctypes than a small
product's own compute.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch

_P = ctypes.c_void_p
OBJECT_BYTES = 32  # ggml.c's struct ggml_object, which precedes each tensor in a context


class Tensor(ctypes.Structure):
    """ggml.h's `struct ggml_tensor`: read for the `extra` ggml sets on an interleaved weight
    (engine.ggml.interleave), written for the `data` of a kept graph's moving tensors."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", _P),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", _P * 10),
        ("view_src", _P),
        ("view_offs", ctypes.c_size_t),
        ("data", _P),
        ("name", ctypes.c_char * 64),
        ("extra", _P),
        ("padding", ctypes.c_char * 8),
    ]


def readable(ggml) -> bool:
    """Whether this ggml's tensors are `Tensor`s: a context spends `OBJECT_BYTES` + the struct on each."""
    return ctypes.sizeof(Tensor) + OBJECT_BYTES == ggml.tensor_overhead()


class KeptGraph:
    def __init__(
        self, ggml, context: int, graph: int, moving: Sequence[tuple[int, int, int]], allocator=None
    ):
        """`moving`: (tensor, index of the argument it lies in, byte offset there) per moving tensor;
        `allocator`: the ggml graph allocator holding the graph's intermediate tensors, if any."""
        self._compute = ggml.graph_compute
        self.graph = graph
        self.moving = [(Tensor.from_address(tensor), index, offset) for tensor, index, offset in moving]
        weakref.finalize(self, _free, ggml, context, allocator)

    def compute(self, backend: int, memories: Sequence[torch.Tensor]) -> int:
        """Run the graph on this call's `memories` (ggml's status: 0 when it computed)."""
        for head, index, offset in self.moving:
            head.data = memories[index].data_ptr() + offset
        return self._compute(backend, self.graph)

    def compute_at(self, backend: int, addresses: Sequence[int]) -> int:
        """`compute` on memories given by their addresses (`data_ptr()`)."""
        for head, index, offset in self.moving:
            head.data = addresses[index] + offset
        return self._compute(backend, self.graph)


def _free(ggml, context: int, allocator: int | None) -> None:
    if allocator:
        ggml.gallocr_free(allocator)
    ggml.free(context)


class KeptGraphs:
    LIMIT = 2048  # ~10 KB of metadata each: a 48-layer model's decode step keeps ~400

    def __init__(self, limit: int | None = None) -> None:
        self._graphs: OrderedDict[Hashable, KeptGraph] = OrderedDict()
        self.limit = self.LIMIT if limit is None else limit

    def get(self, key: Hashable) -> KeptGraph | None:
        return self._graphs.get(key)

    def keep(self, key: Hashable, graph: KeptGraph) -> None:
        self._graphs[key] = graph
        while len(self._graphs) > self.limit:
            self._graphs.popitem(last=False)


class ThreadsKeptGraphs(threading.local):
    """Each thread's own `KeptGraphs` of at most `limit` graphs: for graphs that hold a KV cache's
    buffers (engine.decode.layer_graph), kept a few at a time, not among every product's; and the
    memory their caller gives them step after step (`buffers`, engine.decode.graph_chain's)."""

    def __init__(self, limit: int) -> None:
        self.graphs = KeptGraphs(limit)
        self.buffers: dict = {}
