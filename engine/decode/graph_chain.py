"""A step's graph: its inputs and its layers chained (`--kernels ggml`).

Contract: `run_layers(ends, hidden, cos, sin, caches, keep, graphs, key, head=None,
embedding=None)` runs layers' `AttentionEnds` (engine.decode.layer_graph) over their KV caches in
one graph kept per step shape and cache buffers: one layer's (`AttentionEnds.whole`) or a step's
every layer and head (engine.decode.whole_step), the step's token ids looked up in the graph too
where an embedding is given. `new_positions` says where a step's new keys and values go among a
cache's rows and what each token sees; `rows_in`, `weight_of`, `rms_normed` and `angles` put a
graph's float32 rows, a `GgmlLinear`'s matrix, an RMS norm and the rotary angles in it.
"""

from __future__ import annotations

import array
import functools
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType

from engine.decode.moe_graph import record_routes
from engine.decode.row_views import Row
from engine.ggml import kernels as ggml_kernels
from engine.ggml.graphs import KeptGraph
from engine.ggml.library import loaded
from engine.resident.ggml_linear import GgmlLinear

F32, F16, I64, I32 = (int(GGMLQuantizationType[name]) for name in ("F32", "F16", "I64", "I32"))
STEP = "a step's layers"  # what a failed compute names
RAN = "ran"  # `graphs.buffers`' key of a `Ran`


def run_layers(
    ends: list, hidden, cos, sin, caches, keep: int, graphs, key, head=None, embedding=None, reuse=False
):
    """`ends`' layers on `hidden [1, T, H]` over their `caches`, their `layer_nodes` chained (the
    last on its last `keep` rows) and `head`'s after them if given, in one graph kept in `graphs`
    under `key` and the step's shape and buffers: the rows `[keep, H]` or the logits `[keep, V]`.
    With an `embedding` (engine.decode.whole_step.Embedding), `hidden` is the step's token ids
    `[1, T]` (int32), looked up in the graph. The layers' MoE blocks route alike (top-k of as
    many experts: `routes_alike`). None where a layer may not (`room`) or the caches differ in
    length or buffers. With `reuse` the output is the one of `_output`, rewritten step after step."""
    tokens = hidden.shape[1]
    rooms = _rooms(ends, caches, tokens)
    if rooms is None:
        return None
    length, capacity = caches[0].get_seq_length(), rooms[0][0].shape[2]
    where, mask = new_positions(length, tokens, capacity, ends[0].kv_heads)
    # a graph's inputs are read where they lie, in rows as the graph was built for: `[T, D]` angles
    # (`[1, T, D]` as the rotary module gives them), `[T, H]` rows or `[T]` ids
    rows = hidden if hidden.is_contiguous() else hidden.contiguous()
    cos, sin = (a if a.is_contiguous() else a.contiguous() for a in (cos, sin))
    width = rows.shape[-1] if embedding is None else None
    out = _output(graphs, (keep, width if head is None else head.lm_head.out_features), reuse)
    moe, layers = ends[0].moe, len(ends)
    # every layer's experts chosen and router logits, in one tensor each: layer i's `[T, K]` and
    # `[T, E]` rows (the last layer's first `keep`) at its place in `[L, T, K]` and `[L, T, E]`
    chosen, read_routes, logits = _routes(graphs, layers, tokens, moe.top_k, moe.num_experts)

    def build(context, bind):
        ggml = loaded()
        if embedding is None:
            x = rows_in(ggml, context, bind, rows)
        else:
            x = embedding.nodes(ggml, context, bind, rows)
        shared = step_inputs(context, bind, cos, sin, where, mask)
        placed = []  # the routes, in the graph's outputs though no later node reads them
        for index, (end, room) in enumerate(zip(ends, rooms, strict=True)):
            count = tokens if index < layers - 1 else keep  # the rows each layer gives the next
            x, *routes = end.layer_nodes(context, bind, x, shared, room, count)
            for node, memory in zip(routes, (chosen, logits), strict=True):
                bind(node, memory, memory[index].data_ptr())
            placed += routes
        return (x if head is None else head.nodes(context, bind, x), *placed)

    size, moving = sum(end.graph_size for end in ends) + 16, (rows, cos, sin, where, mask, chosen, logits)
    kept = (key, tokens, keep, capacity, *(buffer.data_ptr() for room in rooms for buffer in room))
    graph = ggml_kernels.compute_kept(kept, build, moving, (out,), STEP, size, size, graphs)
    for cache in caches:
        cache.written(tokens)
    record_routes(tuple(end.moe for end in ends), read_routes(), logits, keep)
    if reuse and tokens == 1:  # what a `OneTokenStep` runs again (engine.decode.one_token)
        graphs.buffers[RAN, key] = Ran.of(graph, rooms, capacity, (*moving, out), length, read_routes)
    return out


class Ran(NamedTuple):
    """The last one-token step `run_layers` ran with `reuse` under a key: its kept graph, the
    cache buffers it wrote (weak references to each layer's keys and values) and their capacity,
    the memories it read and wrote (the graph's moving order: token rows or ids, cos, sin, where
    the new keys go, mask, experts chosen, router logits, output), the positions cached before it
    and how its experts chosen are read."""

    graph: KeptGraph
    rooms: list[tuple[weakref.ref, weakref.ref]]
    capacity: int
    memories: tuple
    length: int
    read_routes: Callable[[], list]

    @classmethod
    def of(cls, graph: KeptGraph, rooms: list, capacity: int, memories: tuple, length: int, read) -> Ran:
        weak = [tuple(weakref.ref(buffer) for buffer in room) for room in rooms]  # not keeping a cache
        return cls(graph, weak, capacity, memories, length, read)


def last_ran(graphs, key) -> Ran | None:
    """This thread's last one-token step run with `reuse` under `key` in `graphs`."""
    return graphs.buffers.get((RAN, key))


def _output(graphs, shape: tuple[int, int], reuse: bool) -> torch.Tensor:
    """A step's output rows or logits `shape`: fresh, or with `reuse` this thread's one buffer of
    that shape in `graphs` (a decode step's logits, sampled before the next step: a fresh tensor
    costs more than reusing the buffer, with the caches cold from the step's weights)."""
    out = graphs.buffers.get(("out", shape)) if reuse else None
    if out is None:
        out = torch.empty(shape)
        if reuse:
            graphs.buffers[("out", shape)] = out
    return out


def _routes(graphs, layers: int, tokens: int, top_k: int, experts: int) -> tuple:
    """A step's experts chosen `[L, T, K]` (int32) for the graph to write and how to read them
    (`[L][T][K]` lists), and its router logits `[L, T, E]`. A one-token step's are the same buffers
    step after step (`graphs.buffers`: this thread's, of this layer or step), the experts read
    through an `array` without torch: they are read before the next step, the trace holds the
    latest step's logits (the next one-token step rewrites them), and a fresh tensor or torch's
    `tolist` cost more than the rest of the step's bookkeeping with the caches cold from the step's
    weights. The reading of a buffer is made with it, once."""
    if tokens != 1:
        chosen = torch.empty((layers, tokens, top_k), dtype=torch.int32)
        return chosen, chosen.tolist, torch.empty((layers, tokens, experts))
    found = graphs.buffers.get(("routes", layers, top_k, experts))
    if found is None:
        values = array.array("i", bytes(4 * layers * top_k))
        chosen = torch.frombuffer(values, dtype=torch.int32).view(layers, 1, top_k)

        def read() -> list:
            flat = values.tolist()
            return [[flat[i : i + top_k]] for i in range(0, layers * top_k, top_k)]

        logits = torch.empty((layers, 1, experts))
        found = graphs.buffers[("routes", layers, top_k, experts)] = (chosen, read, logits)
    return found


def _rooms(ends: list, caches, tokens: int) -> list | None:
    """Each layer's cache buffers with room for `tokens` more (`AttentionEnds.room`); None where a
    layer may not run in the graph or the caches differ in length or capacity."""
    rooms = []
    for end, cache in zip(ends, caches, strict=True):
        room = end.room(cache, tokens)
        if room is None:
            return None
        rooms.append(room)
    length, capacity = caches[0].get_seq_length(), rooms[0][0].shape[2]
    if any(c.get_seq_length() != length for c in caches) or any(r[0].shape[2] != capacity for r in rooms):
        return None
    return rooms


def routes_alike(ends: list) -> bool:
    """Whether `ends`' MoE blocks choose as many of as many experts (`run_layers` keeps their
    routes in one tensor)."""
    return len({(end.moe.top_k, end.moe.num_experts) for end in ends}) == 1


def angles(context, bind, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int]:
    """The rotary cos and sin `[.., T, D]` (contiguous) as ggml tensors `[D, 1, T]`."""
    ggml, (tokens, dim) = loaded(), cos.shape[-2:]
    tensors = tuple(ggml.new_tensor_3d(context, F32, dim, 1, tokens) for _ in range(2))
    for tensor, values in zip(tensors, (cos, sin), strict=True):
        bind(tensor, values)
    return tensors


def step_inputs(context, bind, cos, sin, where: torch.Tensor, mask: torch.Tensor) -> tuple:
    """A step's inputs every layer's `layer_nodes` shares: the rotary angles, where the new keys
    and values go and the attention mask (`new_positions`), as ggml tensors."""
    ggml = loaded()
    index = ggml.new_tensor_1d(context, I64, where.numel())
    seen = ggml.new_tensor_2d(context, F16, mask.shape[1], mask.shape[0])
    bind(index, where)
    bind(seen, mask)
    return (*angles(context, bind, cos, sin), index, seen)


def new_positions(length: int, tokens: int, capacity: int, heads: int) -> tuple:
    """Where a step's `tokens` new keys (values) go among a `[heads, capacity]` cache's rows, in the
    graph's (token, head) order, and the attention mask `[T, capacity]` (0: seen; token t sees
    the `length` cached positions and the new ones up to its own); a decode step's as `Row`s."""
    if tokens == 1:  # rows of a table of every length's rows and of a ramp of zeros then -inf
        where, ramp = _decode_positions(capacity, heads)
        return Row.of(where, length * heads, (heads,)), Row.of(ramp, capacity - 1 - length, (1, capacity))
    return _positions(length, tokens, capacity, heads)


@functools.lru_cache(maxsize=4)  # the layers of a step going layer by layer share them
def _positions(length: int, tokens: int, capacity: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = length + torch.arange(tokens)
    where = (torch.arange(heads)[None, :] * capacity + positions[:, None]).reshape(-1)
    seen = torch.arange(capacity)[None, :] <= positions[:, None]
    mask = torch.zeros((tokens, capacity), dtype=torch.float16).masked_fill_(~seen, float("-inf"))
    return where, mask


@functools.lru_cache(maxsize=4)
def _decode_positions(capacity: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each length's rows for its one new position `[capacity, heads]`, and `capacity` zeros then
    `capacity` -inf."""
    where = torch.arange(capacity)[:, None] + torch.arange(heads)[None, :] * capacity
    ramp = torch.zeros(2 * capacity, dtype=torch.float16)
    ramp[capacity:] = float("-inf")
    return where.contiguous(), ramp


def rows_in(ggml, context, bind, rows: torch.Tensor) -> int:
    """Contiguous float32 rows `[.., H]` as a ggml tensor `[H, rows]`."""
    tensor = ggml.new_tensor_2d(context, F32, rows.shape[-1], rows.numel() // rows.shape[-1])
    bind(tensor, rows)
    return tensor


def weight_of(ggml, context, bind, linear: GgmlLinear) -> int:
    tensor = ggml.new_tensor_2d(context, linear.ggml_type, linear.in_features, linear.out_features)
    bind(tensor, linear.blocks)
    return tensor


def rms_normed(ggml, context, bind, x: int, norm: tuple[torch.Tensor, float]) -> int:
    """RMS norm over ggml's first dimension, times the norm's weight."""
    weight, eps = norm
    scale = ggml.new_tensor_1d(context, F32, weight.numel())
    bind(scale, weight)
    return ggml.mul(context, ggml.rms_norm(context, x, eps), scale)
