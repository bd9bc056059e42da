"""llama.cpp's own CPU matmul kernels, on a GGUF weight's blocks where they lie (`--kernels ggml`).

Contract (where engine.ggml.library.available()): `linear(x, blocks, ggml_type, out, in)`
is `x @ W.T` for the weight `W [out, in]` whose ggml blocks are `blocks` (uint8, `[out, row
bytes]`, the file's layout), computed by ggml's CPU backend with as many threads as torch uses;
`linear_routed(x, experts, field, ids)` runs every route of a MoE layer through its experts where
they lie in a packed layer buffer, in one node (`ggml_mul_mat_id`, as llama.cpp runs the layer).

This is the path llama.cpp computes on: the activations are quantized to 8 bits per block
(Q8_K for the K-quants, Q8_0 for the others) and multiplied with integer dot products, so the
result differs from `x @ dequantize(W).T` by about a percent of its scale, as llama.cpp's own
outputs do; the engine's default kernels (engine.formats.gguf.repack, engine.resident.ggml_linear)
stay exact and this one is chosen by name only. A call makes one graph (a one-token call's is kept
and only pointed at the call's memory: engine.ggml.graphs): ggml tensors are described in
a per-thread metadata context (no allocation), bound to the caller's memory through one CPU
buffer made over the whole address space (`ggml_backend_cpu_buffer_from_ptr`: it owns nothing and
only bounds where tensors may lie; a buffer a call cost 6 of a matmul call's 16 foreign calls) or,
for memory ggml allocated itself, that memory's own buffer; and computed by the CPU backend. Every
argument is checked here first: ggml aborts the process on a failed assertion.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.ggml import memory as ggml_memory
from engine.ggml.graphs import KeptGraph, KeptGraphs, readable
from engine.ggml.library import Ggml, InitParams, library, loaded

_F32 = int(GGMLQuantizationType.F32)
_I32 = int(GGMLQuantizationType.I32)


# Graph slots: ggml's default 2048-slot graph costs more to set up than a decode step's matmul
# takes to run; a call's graph has at most five nodes (routed_swiglu's two views and three
# products) and four leaves.
_GRAPH_SIZE = 8
_MAX_TENSORS = 12  # tensors a call describes in its context (routed_swiglu's: two views and seven)


class _ThreadState(threading.local):
    context: int | None = None
    backend: int | None = None
    threads = 0
    kept: KeptGraphs | None = None  # one-token products' graphs (engine.ggml.graphs)


_state = _ThreadState()


def _context_bytes(ggml: Ggml, tensors: int = _MAX_TENSORS, nodes: int = _GRAPH_SIZE) -> int:
    return ggml.tensor_overhead() * tensors + ggml.graph_overhead_custom(nodes, False) + 4096


def _context(ggml: Ggml) -> tuple[int, int]:
    """This thread's metadata context (reset for each call) and CPU backend."""
    if _state.context is None:
        _state.context = ggml.init(InitParams(_context_bytes(ggml), None, True))
        if not _state.context:
            raise RuntimeError("ggml could not make a context")
    ggml.reset(_state.context)
    return _state.context, _backend(ggml)


def _backend(ggml: Ggml) -> int:
    """This thread's CPU backend, computing with as many threads as torch."""
    if _state.backend is None:
        _state.backend = ggml.cpu_init()
        if not _state.backend:
            raise RuntimeError("ggml could not make a CPU backend")
    threads = torch.get_num_threads()
    if threads != _state.threads:
        ggml.cpu_set_n_threads(_state.backend, threads)
        _state.threads = threads
    return _state.backend


def _checked(ggml: Ggml, blocks: torch.Tensor, ggml_type: int, out_features: int, in_features: int) -> None:
    row = _row_bytes(ggml, int(ggml_type), in_features)
    if row is None or blocks.dtype != torch.uint8 or blocks.device.type != "cpu":
        raise ValueError(f"ggml cannot multiply a {out_features}×{in_features} weight in {ggml_type} blocks")
    if not blocks.is_contiguous() or blocks.numel() != row * out_features:
        raise ValueError(f"{blocks.numel()} bytes do not hold a {out_features}×{in_features} weight")


def _float_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """`x` as contiguous float32 rows on the CPU, converted only where needed."""
    rows = x.reshape(-1, in_features)
    if rows.dtype != torch.float32 or rows.device.type != "cpu":
        rows = rows.to(device="cpu", dtype=torch.float32)
    return rows if rows.is_contiguous() else rows.contiguous()


def linear(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, out_features: int, in_features: int
) -> torch.Tensor:
    """`x @ W.T` by ggml's CPU kernels, `x [..., in]`, in x's dtype (computed in float32)."""
    ggml = loaded()
    _checked(ggml, blocks, ggml_type, out_features, in_features)
    rows = _float_rows(x, in_features)
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    if rows.shape[0]:
        key = None  # several tokens: the graph is built for the call
        if rows.shape[0] == 1:
            buffer = ggml_memory.buffer_of(ggml, blocks)
            key = ("mm", blocks.data_ptr(), buffer, int(ggml_type), out_features, in_features)
        _compute(ggml, rows, out, blocks, int(ggml_type), key)
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def linear_routed(
    x: torch.Tensor,
    experts: torch.Tensor,
    field: tuple[int, int, int, int],
    ids: list[list[int]],
) -> torch.Tensor:
    """Each token through each of its routed experts in one ggml node (`ggml_mul_mat_id`, as
    llama.cpp runs a MoE layer): `out[t, k] = x[t] @ W[ids[t][k]].T`, or `x[t, k] @ …` for
    `x [T, K, in]` (a row per route); `[T, K, out]` float32. `experts` is a layer's packed experts
    (uint8 `[E, bytes an expert]`), `field` = (byte offset in an expert, ggml type, out, in) of the
    weight `W[e]` inside each; `ids` the `[T][K]` experts' indices (host values: checked here
    without a device read). A token's row is quantized once for all its experts, and the threads
    share one node instead of one per expert."""
    ggml = _checked_routes(x.shape, experts, field, ids)
    rows, routes = _float_rows(x, field[3]), torch.tensor(ids, dtype=torch.int32)  # [T or T·K, in]
    out = torch.empty((len(ids), routes.shape[-1], field[2]), dtype=torch.float32)
    if ids:

        def build(context, bind):
            activations, index = _routed_inputs(ggml, context, bind, rows, routes)
            return ggml.mul_mat_id(
                context, _experts_view(ggml, context, bind, experts, field), activations, index
            )

        key = _routed_key(ggml, experts, (field,), x, ids)
        _run(ggml, build, out, "a routed matmul", (rows, routes), key)
    return out


def routed_swiglu(
    x: torch.Tensor,
    experts: torch.Tensor,
    gate_up: tuple[int, int, int, int],
    down: tuple[int, int, int, int],
    ids: list[list[int]],
) -> torch.Tensor:
    """`down(silu(gate(x)) · up(x))` of every route in one ggml graph, llama.cpp's MoE FFN: the
    `linear_routed` products of `gate_up` (gate rows, then up rows: transformers' `gate_up_proj`)
    and `down` with ggml's SwiGLU between them, no tensor of the step leaving ggml; `[T, K, out]`
    float32 for `x [T, in]` (or `[T, K, in]`, a row per route, as `linear_routed` takes)."""
    ggml = _checked_routes(x.shape, experts, gate_up, ids)
    _checked_field(ggml, experts, down)  # the routes were checked with gate_up
    if gate_up[2] != 2 * down[3]:
        raise ValueError(f"{gate_up[2]} gate and up rows do not feed a down projection of width {down[3]}")
    rows, routes = _float_rows(x, gate_up[3]), torch.tensor(ids, dtype=torch.int32)
    tokens, top_k = len(ids), routes.shape[-1]
    up = torch.empty((tokens, top_k, gate_up[2]), dtype=torch.float32)
    act = torch.empty((tokens, top_k, down[3]), dtype=torch.float32)
    out = torch.empty((tokens, top_k, down[2]), dtype=torch.float32)
    if ids:

        def build(context, bind):
            activations, index = _routed_inputs(ggml, context, bind, rows, routes)
            return swiglu_nodes(ggml, context, bind, experts, (gate_up, down), activations, index, (up, act))

        key = _routed_key(ggml, experts, (gate_up, down), x, ids)
        _run(ggml, build, out, "a routed MLP", (rows, routes, up, act), key)
    return out


def swiglu_nodes(ggml: Ggml, context, bind, experts: torch.Tensor, fields, activations, index, bound=()):
    """The nodes of `routed_swiglu` on ggml tensors `activations [in, rows a token, T]` and `index
    [K, T]` (I32), `fields` = (gate_up, down) in `experts`: `[out, K, T]`; `bound` = memory for the
    gate/up product and the gated rows (else ggml's graph allocator places them)."""
    gate_up, down = fields
    both = ggml.mul_mat_id(context, _experts_view(ggml, context, bind, experts, gate_up), activations, index)
    gated = ggml.swiglu(context, both)  # silu(first half) · second half, row by row
    for tensor, memory in zip((both, gated), bound, strict=False):
        bind(tensor, memory)
    return ggml.mul_mat_id(context, _experts_view(ggml, context, bind, experts, down), gated, index)


def checked_field(experts: torch.Tensor, field) -> None:
    """ValueError unless `field` is a weight ggml multiplies lying inside each of `experts`' rows."""
    _checked_field(loaded(), experts, field)


def _checked_routes(shape: tuple[int, ...], experts: torch.Tensor, field, ids: list[list[int]]) -> Ggml:
    """ggml, once activations of `shape` and `ids` fit a routed product of `field` inside
    `experts` (else ValueError)."""
    ggml = loaded()
    _checked_field(ggml, experts, field)
    in_features, num_experts = field[3], experts.shape[0]
    tokens, top_k = len(ids), len(ids[0]) if ids else 0
    if shape[0] != tokens or shape[-1] != in_features or (len(shape) == 3 and shape[1] != top_k):
        raise ValueError(f"activations {tuple(shape)} do not fit {tokens}×{top_k} routes")
    if any(len(token) != top_k or min(token) < 0 or max(token) >= num_experts for token in ids):
        raise ValueError(f"a route names an expert outside 0..{num_experts - 1} (or routes differ in length)")
    return ggml


def _checked_field(ggml: Ggml, experts: torch.Tensor, field) -> None:
    """ValueError unless `field` is a weight ggml multiplies lying inside each of `experts`' rows."""
    offset, ggml_type, out_features, in_features = field
    stride = experts.shape[1]
    row = _row_bytes(ggml, int(ggml_type), in_features)
    if row is None or experts.dtype != torch.uint8 or not experts.is_contiguous():
        raise ValueError(f"ggml cannot multiply a {out_features}×{in_features} weight in {ggml_type} blocks")
    if offset < 0 or offset + row * out_features > stride:
        raise ValueError(f"a {out_features}×{in_features} weight at byte {offset} overruns {stride} bytes")


def _routed_inputs(ggml: Ggml, context, bind, rows: torch.Tensor, routes: torch.Tensor) -> tuple[int, int]:
    """The activations `[T, rows a token, in]` and the `[T, K]` expert indices as ggml tensors."""
    tokens, top_k = routes.shape
    activations = ggml.new_tensor_3d(context, _F32, rows.shape[1], rows.shape[0] // tokens, tokens)
    index = ggml.new_tensor_2d(context, _I32, top_k, tokens)
    bind(activations, rows)
    bind(index, routes)
    return activations, index


def _experts_view(ggml: Ggml, context, bind, experts: torch.Tensor, field) -> int:
    """Every expert's weight `field`, `stride` bytes apart: a 3-D view `[E, out, in]` over the
    layer's memory seen as rows of the field's type."""
    offset, ggml_type, out_features, in_features = field
    num_experts, stride = experts.shape
    row = _row_bytes(ggml, int(ggml_type), in_features)
    whole = ggml.new_tensor_2d(context, int(ggml_type), in_features, (num_experts * stride - offset) // row)
    bind(whole, experts, experts.data_ptr() + offset)
    weights = ggml.view_3d(context, whole, in_features, out_features, num_experts, row, stride, 0)
    if ggml.view_init(weights) != 0:
        raise RuntimeError("ggml could not view a layer's experts")
    return weights


def _compute(ggml: Ggml, rows, out, blocks, ggml_type: int, key) -> None:
    """`out = rows @ W.T` in a one-node graph (kept under `key`, unless None)."""

    def build(context, bind):
        weight = ggml.new_tensor_2d(context, ggml_type, rows.shape[1], out.shape[1])
        activations = ggml.new_tensor_2d(context, _F32, rows.shape[1], rows.shape[0])
        bind(weight, blocks)
        bind(activations, rows)
        return ggml.mul_mat(context, weight, activations)  # [rows, out] in ggml's ne order

    _run(ggml, build, out, "a matmul", (rows,), key)


def _routed_key(ggml: Ggml, experts: torch.Tensor, fields: tuple, x: torch.Tensor, ids: list[list[int]]):
    """What a one-token routed graph depends on (None for several tokens: not kept)."""
    if len(ids) != 1:
        return None
    return (
        "id",
        experts.data_ptr(),
        ggml_memory.buffer_of(ggml, experts),
        experts.shape,
        fields,
        len(ids[0]),
        x.dim(),
    )


def _run(ggml: Ggml, build, out: torch.Tensor, what: str, moving: tuple = (), key=None) -> None:
    """Compute the product `build(context, bind)` describes into `out`: `bind(tensor, memory,
    address=memory's start)` places a tensor in caller memory. `moving` is the call's memory
    other than `out` and the weights; with a `key`, the graph is kept and later calls under that
    key only point its tensors at their `moving` memory and `out` (engine.ggml.graphs)."""
    memories = (*moving, out)
    if key is not None and readable(ggml):
        status = _kept(ggml, key, build, memories).compute(_backend(ggml), memories)
    else:
        context, backend = _context(ggml)
        graph = ggml.new_graph_custom(context, _GRAPH_SIZE, False)
        for product in _built(ggml, context, build, memories, []):
            ggml.build_forward_expand(graph, product)
        status = ggml.graph_compute(backend, graph)
    if status != 0:
        raise RuntimeError(f"ggml's CPU backend failed to compute {what}")


def compute_kept(
    key, build, moving: tuple, outputs: tuple, what: str, tensors: int, nodes: int, graphs=None
) -> KeptGraph:
    """A graph of several outputs kept under `key` (engine.decode.layer_graph): `build(context,
    bind)` returns its products, one for each of `outputs` (bound there) apart from those it placed
    itself in `moving` memory (`bind(tensor, memory, address)`); `moving` is the call's other
    memory; `tensors` and `nodes` bound the graph's size; `graphs` a `ThreadsKeptGraphs` to keep
    it in (else this thread's); the graph it ran. Needs `kept_graphs_work()`."""
    ggml, memories = loaded(), (*moving, *outputs)
    kept = _kept(ggml, key, build, memories, (tensors, nodes), graphs, intermediates=True)
    if kept.compute(_backend(ggml), memories) != 0:
        raise RuntimeError(f"ggml's CPU backend failed to compute {what}")
    return kept


def compute_again(kept: KeptGraph, addresses: Sequence[int], what: str) -> None:
    """A graph `compute_kept` gave, run again on the memories at `addresses` (in its order of
    `moving` then `outputs`)."""
    if kept.compute_at(_backend(loaded()), addresses) != 0:
        raise RuntimeError(f"ggml's CPU backend failed to compute {what}")


def _kept(
    ggml: Ggml, key, build, memories: tuple, size=(_MAX_TENSORS, _GRAPH_SIZE), graphs=None, **keep
) -> KeptGraph:
    """This thread's graph kept under `key` (in `graphs`, else among every product's), built by
    `_keep` (`size`: tensors and nodes, `keep`: its other options) the first time it is asked for."""
    if graphs is not None:
        kept_graphs = graphs.graphs
    else:
        if _state.kept is None:
            _state.kept = KeptGraphs()
        kept_graphs = _state.kept
    kept = kept_graphs.get(key)
    if kept is None:
        kept = _keep(ggml, build, memories, *size, **keep)
        kept_graphs.keep(key, kept)
    return kept


def kept_graphs_work() -> bool:
    """Whether ggml is here and its graphs can be kept (its tensors read as engine.ggml.graphs.Tensor)."""
    ggml, _ = library()
    return ggml is not None and readable(ggml)


def _built(ggml: Ggml, context: int, build, memories: tuple, moving: list) -> tuple[int, ...]:
    """The products `build` describes (one, or a tuple), those it did not place itself bound to the
    last of `memories`; each tensor placed in one of `memories` appended to `moving` as (tensor,
    which, byte offset)."""

    def bind(tensor: int, memory: torch.Tensor, address: int | None = None) -> None:
        address = memory.data_ptr() if address is None else address
        ggml_memory.bind(ggml, tensor, ggml_memory.buffer_of(ggml, memory), address)
        which = next((i for i, m in enumerate(memories) if m is memory), None)
        if which is not None:
            moving.append((tensor, which, address - memory.data_ptr()))

    products = build(context, bind)
    products = products if isinstance(products, tuple) else (products,)
    bound = {tensor for tensor, _, _ in moving}  # placed by `build` itself: not outputs
    unbound = [product for product in products if product not in bound]
    for product, memory in zip(unbound, memories[len(memories) - len(unbound) :], strict=True):
        bind(product, memory)
    return products


def _keep(
    ggml: Ggml,
    build,
    memories: tuple,
    tensors: int = _MAX_TENSORS,
    nodes: int = _GRAPH_SIZE,
    intermediates: bool = False,
) -> KeptGraph:
    """`build`'s graph in a context of its own, to be run again on other memories; with
    `intermediates`, the tensors between its nodes get memory of their own (ggml's allocator)."""
    context = ggml.init(InitParams(_context_bytes(ggml, tensors, nodes), None, True))
    if not context:
        raise RuntimeError("ggml could not make a context")
    allocator = None
    try:
        moving: list = []
        graph = ggml.new_graph_custom(context, nodes, False)
        for product in _built(ggml, context, build, memories, moving):
            ggml.build_forward_expand(graph, product)
        if intermediates:
            allocator = ggml.gallocr_new(ggml.cpu_buffer_type())
            if not allocator or not ggml.gallocr_alloc_graph(allocator, graph):
                raise RuntimeError("ggml could not allocate a graph's intermediate tensors")
    except BaseException:
        if allocator:
            ggml.gallocr_free(allocator)
        ggml.free(context)
        raise
    return KeptGraph(ggml, context, graph, moving, allocator)


@functools.cache
def _row_bytes(ggml: Ggml, ggml_type: int, in_features: int) -> int | None:
    """Bytes of one row of `in_features` weights in `ggml_type` blocks; None when rows of that
    width do not fill whole blocks."""
    block_weights, _ = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return None if in_features % block_weights else ggml.row_size(ggml_type, in_features)
