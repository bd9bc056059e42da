"""A step's graph: its inputs and its layers chained (`--kernels ggml`).

Contract: `run_layers(ends, hidden, cos, sin, caches, keep, graphs, key, head=None,
embedding=None)` runs layers' `AttentionEnds` (engine.offload.ggml_layer) over their KV caches in
one graph kept per step shape and cache buffers: one layer's (`AttentionEnds.whole`) or a step's
every layer and head (engine.offload.ggml_step), the step's token ids looked up in the graph too
where an embedding is given. `new_positions` says where a step's new keys and values go among a
cache's rows and what each token sees; `rows_in`, `weight_of`, `rms_normed` and `angles` put a
graph's float32 rows, a `GgmlLinear`'s matrix, an RMS norm and the rotary angles in it.
"""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType

from engine.offload import ggml_kernels
from engine.offload.ggml_library import loaded
from engine.offload.ggml_moe import record_routes
from engine.offload.ggml_resident import GgmlLinear

F32, F16, I64, I32 = (int(GGMLQuantizationType[name]) for name in ("F32", "F16", "I64", "I32"))


def run_layers(
    ends: list, hidden: torch.Tensor, cos, sin, caches, keep: int, graphs, key, head=None, embedding=None
):
    """`ends`' layers on `hidden [1, T, H]` over their `caches`, their `layer_nodes` chained (the
    last on its last `keep` rows) and `head`'s after them if given, in one graph kept in `graphs`
    under `key` and the step's shape and buffers: the rows `[keep, H]` or the logits `[keep, V]`.
    With an `embedding` (engine.offload.ggml_step.Embedding), `hidden` is the step's token ids
    `[1, T]` (int32), looked up in the graph. None where a layer may not (`room`) or the caches
    differ in length or buffers."""
    tokens, rooms = hidden.shape[1], []
    for end, cache in zip(ends, caches, strict=True):
        room = end.room(cache, tokens)
        if room is None:
            return None
        rooms.append(room)
    length, capacity = caches[0].get_seq_length(), rooms[0][0].shape[2]
    if any(c.get_seq_length() != length for c in caches) or any(r[0].shape[2] != capacity for r in rooms):
        return None
    where, mask = new_positions(length, tokens, capacity, ends[0].kv_heads)
    # a graph's inputs are read where they lie, in rows as the graph was built for: `[T, D]` angles
    # (`[1, T, D]` as the rotary module gives them), `[T, H]` rows or `[T]` ids
    rows = hidden if hidden.is_contiguous() else hidden.contiguous()
    cos, sin = (a if a.is_contiguous() else a.contiguous() for a in (cos, sin))
    width = rows.shape[-1] if embedding is None else None
    out = torch.empty((keep, width if head is None else head.lm_head.out_features))
    kept = [tokens] * (len(ends) - 1) + [keep]  # the rows each layer gives the next
    routes = []  # each layer's experts chosen and router logits
    for end, count in zip(ends, kept, strict=True):
        routes += [
            torch.empty((count, end.moe.top_k), dtype=torch.int32),
            torch.empty((count, end.moe.num_experts)),
        ]

    def build(context, bind):
        ggml, nodes = loaded(), []
        if embedding is None:
            x = rows_in(ggml, context, bind, rows)
        else:
            x = embedding.nodes(ggml, context, bind, rows)
        shared = step_inputs(context, bind, cos, sin, where, mask)
        for end, room, count in zip(ends, rooms, kept, strict=True):
            x, *route = end.layer_nodes(context, bind, x, shared, room, count)
            nodes += route
        return (x if head is None else head.nodes(context, bind, x), *nodes)

    size = sum(end.graph_size for end in ends) + 16
    ggml_kernels.compute_kept(
        (key, tokens, keep, capacity, *(buffer.data_ptr() for room in rooms for buffer in room)),
        build,
        (rows, cos, sin, where, mask),
        (out, *routes),
        "a step's layers",
        size,
        size,
        graphs,
    )
    for cache in caches:
        cache.written(tokens)
    record_routes([end.moe for end in ends], routes)
    return out


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


@functools.lru_cache(maxsize=4)  # a step's layers share them
def new_positions(length: int, tokens: int, capacity: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a step's `tokens` new keys (values) go among a `[heads, capacity]` cache's rows, in the
    graph's (token, head) order, and the attention mask `[T, capacity]` (0: seen; token t sees
    the `length` cached positions and the new ones up to its own)."""
    if tokens == 1:  # a decode step: one addition and a slice of a ramp of zeros then -inf
        first, ramp = _decode_positions(capacity, heads)
        return first + length, ramp[capacity - 1 - length : 2 * capacity - 1 - length].view(1, capacity)
    positions = length + torch.arange(tokens)
    where = (torch.arange(heads)[None, :] * capacity + positions[:, None]).reshape(-1)
    seen = torch.arange(capacity)[None, :] <= positions[:, None]
    mask = torch.zeros((tokens, capacity), dtype=torch.float16).masked_fill_(~seen, float("-inf"))
    return where, mask


@functools.lru_cache(maxsize=4)
def _decode_positions(capacity: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's first row among a cache's, and `capacity` zeros then `capacity` -inf."""
    ramp = torch.zeros(2 * capacity, dtype=torch.float16)
    ramp[capacity:] = float("-inf")
    return torch.arange(heads) * capacity, ramp


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
