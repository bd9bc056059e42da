"""llama.cpp's own CPU matmul kernels, on a GGUF weight's blocks where they lie (`--kernels ggml`).

Contract: `available()` says whether ggml's shared libraries can be loaded (they come with the
optional `llama-cpp-python` package, the `llama` extra) and why not; `linear(x, blocks, ggml_type,
out, in)` is `x @ W.T` for the weight `W [out, in]` whose ggml blocks are `blocks` (uint8, `[out,
row bytes]`, the file's layout), computed by ggml's CPU backend with as many threads as torch uses;
`linear_routed(x, experts, field, ids)` runs every route of a MoE layer through its experts where
they lie in a packed layer buffer, in one node (`ggml_mul_mat_id`, as llama.cpp runs the layer).

This is the path llama.cpp computes on: the activations are quantized to 8 bits per block
(Q8_K for the K-quants, Q8_0 for the others) and multiplied with integer dot products, so the
result differs from `x @ dequantize(W).T` by about a percent of its scale, as llama.cpp's own
outputs do; the engine's default kernels (engine.offload.ggml_repack, ggml_linear) stay exact and
this one is chosen by name only. A call makes one graph: ggml tensors are described in
a per-thread metadata context (no allocation), bound to the caller's memory through one CPU
buffer made over the whole address space (`ggml_backend_cpu_buffer_from_ptr`: it owns nothing and
only bounds where tensors may lie; a buffer a call cost 6 of a matmul call's 16 foreign calls) or,
for memory ggml allocated itself, that memory's own buffer; and computed by the CPU backend. Every
argument is checked here first: ggml aborts the process on a failed assertion.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import threading
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT
_F32 = int(GGMLQuantizationType.F32)
_I32 = int(GGMLQuantizationType.I32)
_P = ctypes.c_void_p
log = logging.getLogger(__name__)


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _P), ("no_alloc", ctypes.c_bool)]


class _Ggml:
    """The few ggml functions this module calls, with their C signatures."""

    def __init__(self, lib_dir: Path):
        base, cpu = _load(lib_dir, "libggml-base.so"), _load(lib_dir, "libggml-cpu.so")
        i64, size = ctypes.c_int64, ctypes.c_size_t
        self.init = _function(base, "ggml_init", _P, _InitParams)
        self.reset = _function(base, "ggml_reset", None, _P)
        self.new_tensor_2d = _function(base, "ggml_new_tensor_2d", _P, _P, ctypes.c_int, i64, i64)
        self.new_tensor_3d = _function(base, "ggml_new_tensor_3d", _P, _P, ctypes.c_int, i64, i64, i64)
        self.view_3d = _function(base, "ggml_view_3d", _P, _P, _P, i64, i64, i64, size, size, size)
        self.view_init = _function(base, "ggml_backend_view_init", ctypes.c_int, _P)
        self.mul_mat = _function(base, "ggml_mul_mat", _P, _P, _P, _P)
        self.mul_mat_id = _function(base, "ggml_mul_mat_id", _P, _P, _P, _P, _P)
        self.swiglu = _function(base, "ggml_swiglu", _P, _P, _P)
        self.new_graph_custom = _function(base, "ggml_new_graph_custom", _P, _P, size, ctypes.c_bool)
        self.build_forward_expand = _function(base, "ggml_build_forward_expand", None, _P, _P)
        self.tensor_overhead = _function(base, "ggml_tensor_overhead", size)
        self.graph_overhead_custom = _function(base, "ggml_graph_overhead_custom", size, size, ctypes.c_bool)
        self.row_size = _function(base, "ggml_row_size", size, ctypes.c_int, i64)
        self.tensor_alloc = _function(base, "ggml_backend_tensor_alloc", ctypes.c_int, _P, _P, _P)
        self.buffer_free = _function(base, "ggml_backend_buffer_free", None, _P)
        self.graph_compute = _function(base, "ggml_backend_graph_compute", ctypes.c_int, _P, _P)
        self.cpu_init = _function(cpu, "ggml_backend_cpu_init", _P)
        self.cpu_set_n_threads = _function(cpu, "ggml_backend_cpu_set_n_threads", None, _P, ctypes.c_int)
        self.cpu_buffer_from_ptr = _function(cpu, "ggml_backend_cpu_buffer_from_ptr", _P, _P, size)
        # llama.cpp's extra CPU buffer types (engine.offload.ggml_interleave)
        self.cpu_reg = _function(cpu, "ggml_backend_cpu_reg", _P)
        self.reg_dev_get = _function(base, "ggml_backend_reg_dev_get", _P, _P, size)
        self.reg_proc_address = _function(base, "ggml_backend_reg_get_proc_address", _P, _P, ctypes.c_char_p)
        self.buft_name = _function(base, "ggml_backend_buft_name", ctypes.c_char_p, _P)
        self.buft_alloc_buffer = _function(base, "ggml_backend_buft_alloc_buffer", _P, _P, size)
        self.buffer_base = _function(base, "ggml_backend_buffer_get_base", _P, _P)
        self.tensor_set = _function(base, "ggml_backend_tensor_set", None, _P, _P, size, size)
        _function(base, "ggml_log_set", None, _LogCallback, _P)(_log_to_logging, None)


def _load(lib_dir: Path, name: str) -> ctypes.CDLL:
    """The library by its soname (`<name>.0`) where the wheel has that file: the name llama.cpp's
    own libraries ask for, so the process holds one ggml (one log, one CPU backend), not a copy
    that a file of another name would load beside it."""
    path = lib_dir / f"{name}.0"
    return ctypes.CDLL(str(path if path.exists() else lib_dir / name), mode=ctypes.RTLD_GLOBAL)


_LogCallback = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_LOG_LEVELS = {3: logging.WARNING, 4: logging.ERROR}  # ggml.h: 1 debug, 2 info, 3 warn, 4 error


@_LogCallback
def _log_to_logging(level: int, text: bytes | None, _user_data) -> None:
    """ggml's warnings and errors into the engine's log; its debug and info lines (one per
    interleaved weight, engine.offload.ggml_interleave) nowhere, instead of on stderr."""
    if level in _LOG_LEVELS and text:
        log.log(_LOG_LEVELS[level], "ggml: %s", text.decode(errors="replace").rstrip())


def _function(lib, name: str, restype, *argtypes):
    function = getattr(lib, name)
    function.restype, function.argtypes = restype, list(argtypes)
    return function


@functools.cache
def _library() -> tuple[_Ggml | None, str]:
    try:
        import llama_cpp
    except ImportError:
        return None, "ggml's kernels come with llama-cpp-python: pip install 'moe-chat[llama]'"
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    try:
        return _Ggml(lib_dir), ""
    except (OSError, AttributeError) as err:
        return None, f"llama-cpp-python's ggml libraries in {lib_dir} cannot be used ({err})"


def available() -> tuple[bool, str]:
    """Whether ggml's kernels can run here, and why not."""
    ggml, reason = _library()
    return ggml is not None, reason


# Graph slots: ggml's default 2048-slot graph costs more to set up than a decode step's matmul
# takes to run; a call's graph has at most five nodes (routed_swiglu's two views and three
# products) and four leaves.
_GRAPH_SIZE = 8
_MAX_TENSORS = 12  # tensors a call describes in its context (routed_swiglu's: two views and seven)


class _ThreadState(threading.local):
    context: int | None = None
    backend: int | None = None
    threads = 0


_state = _ThreadState()


def _context(ggml: _Ggml) -> tuple[int, int]:
    """This thread's metadata context (reset for each call) and CPU backend."""
    if _state.context is None:
        size = ggml.tensor_overhead() * _MAX_TENSORS + ggml.graph_overhead_custom(_GRAPH_SIZE, False)
        _state.context = ggml.init(_InitParams(size + 4096, None, True))
        _state.backend = ggml.cpu_init()
        if not _state.context or not _state.backend:
            raise RuntimeError("ggml could not make a context or a CPU backend")
    ggml.reset(_state.context)
    threads = torch.get_num_threads()
    if threads != _state.threads:
        ggml.cpu_set_n_threads(_state.backend, threads)
        _state.threads = threads
    return _state.context, _state.backend


# Memory ggml allocated itself, such as llama.cpp's interleaved rows (engine.offload.ggml_interleave):
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
def _everywhere(ggml: _Ggml) -> int:
    """A CPU buffer from the first aligned address to the end of user memory: a tensor bound to it
    may lie anywhere; it owns no memory and lives as long as the process."""
    buffer = ggml.cpu_buffer_from_ptr(_ALIGNMENT, _ADDRESS_SPACE - _ALIGNMENT)
    if not buffer:
        raise RuntimeError("ggml could not make a CPU buffer over the address space")
    return buffer


def _buffer(ggml: _Ggml, memory: torch.Tensor) -> int:
    """The buffer `memory` is bound through: ggml's own where ggml allocated it, else `_everywhere`."""
    if _owned and (owner := owned_buffer(memory.data_ptr())) is not None:
        return owner[1]
    return _everywhere(ggml)


def _bind(ggml: _Ggml, tensor: int, buffer: int, address: int) -> None:
    if ggml.tensor_alloc(buffer, tensor, address) != 0:
        raise RuntimeError("ggml could not bind a tensor to its memory")


def _checked(ggml: _Ggml, blocks: torch.Tensor, ggml_type: int, out_features: int, in_features: int) -> None:
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
    ggml, reason = _library()
    if ggml is None:
        raise RuntimeError(reason)
    _checked(ggml, blocks, ggml_type, out_features, in_features)
    rows = _float_rows(x, in_features)
    out = torch.empty((rows.shape[0], out_features), dtype=torch.float32)
    if rows.shape[0]:
        _compute(ggml, rows, out, blocks, int(ggml_type))
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

        _run(ggml, build, out, "a routed matmul")
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
    _checked_routes((len(ids), len(ids[0]) if ids else 0, down[3]), experts, down, ids)
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
            both = ggml.mul_mat_id(
                context, _experts_view(ggml, context, bind, experts, gate_up), activations, index
            )
            bind(both, up)
            gated = ggml.swiglu(context, both)  # silu(first half) · second half, row by row
            bind(gated, act)
            return ggml.mul_mat_id(context, _experts_view(ggml, context, bind, experts, down), gated, index)

        _run(ggml, build, out, "a routed MLP")
    return out


def _checked_routes(shape: tuple[int, ...], experts: torch.Tensor, field, ids: list[list[int]]) -> _Ggml:
    """ggml, once activations of `shape` and `ids` fit a routed product of `field` inside
    `experts` (else ValueError)."""
    ggml, reason = _library()
    if ggml is None:
        raise RuntimeError(reason)
    offset, ggml_type, out_features, in_features = field
    num_experts, stride = experts.shape
    tokens, top_k = len(ids), len(ids[0]) if ids else 0
    row = _row_bytes(ggml, int(ggml_type), in_features)
    if row is None or experts.dtype != torch.uint8 or not experts.is_contiguous():
        raise ValueError(f"ggml cannot multiply a {out_features}×{in_features} weight in {ggml_type} blocks")
    if offset < 0 or offset + row * out_features > stride:
        raise ValueError(f"a {out_features}×{in_features} weight at byte {offset} overruns {stride} bytes")
    if shape[0] != tokens or shape[-1] != in_features or (len(shape) == 3 and shape[1] != top_k):
        raise ValueError(f"activations {tuple(shape)} do not fit {tokens}×{top_k} routes")
    if any(len(token) != top_k or min(token) < 0 or max(token) >= num_experts for token in ids):
        raise ValueError(f"a route names an expert outside 0..{num_experts - 1} (or routes differ in length)")
    return ggml


def _routed_inputs(ggml: _Ggml, context, bind, rows: torch.Tensor, routes: torch.Tensor) -> tuple[int, int]:
    """The activations `[T, rows a token, in]` and the `[T, K]` expert indices as ggml tensors."""
    tokens, top_k = routes.shape
    activations = ggml.new_tensor_3d(context, _F32, rows.shape[1], rows.shape[0] // tokens, tokens)
    index = ggml.new_tensor_2d(context, _I32, top_k, tokens)
    bind(activations, rows)
    bind(index, routes)
    return activations, index


def _experts_view(ggml: _Ggml, context, bind, experts: torch.Tensor, field) -> int:
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


def _compute(ggml: _Ggml, rows, out, blocks, ggml_type: int) -> None:
    """`out = rows @ W.T` in a one-node graph."""

    def build(context, bind):
        weight = ggml.new_tensor_2d(context, ggml_type, rows.shape[1], out.shape[1])
        activations = ggml.new_tensor_2d(context, _F32, rows.shape[1], rows.shape[0])
        bind(weight, blocks)
        bind(activations, rows)
        return ggml.mul_mat(context, weight, activations)  # [rows, out] in ggml's ne order

    _run(ggml, build, out, "a matmul")


def _run(ggml: _Ggml, build, out: torch.Tensor, what: str) -> None:
    """Compute the product `build(context, bind)` describes into `out`: `bind(tensor, memory,
    address=memory's start)` places a tensor in caller memory."""
    context, backend = _context(ggml)
    graph = ggml.new_graph_custom(context, _GRAPH_SIZE, False)

    def bind(tensor: int, memory: torch.Tensor, address: int | None = None) -> None:
        address = memory.data_ptr() if address is None else address
        _bind(ggml, tensor, _buffer(ggml, memory), address)

    product = build(context, bind)
    bind(product, out)
    ggml.build_forward_expand(graph, product)
    if ggml.graph_compute(backend, graph) != 0:
        raise RuntimeError(f"ggml's CPU backend failed to compute {what}")


@functools.cache
def _row_bytes(ggml: _Ggml, ggml_type: int, in_features: int) -> int | None:
    """Bytes of one row of `in_features` weights in `ggml_type` blocks; None when rows of that
    width do not fill whole blocks."""
    block_weights, _ = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return None if in_features % block_weights else ggml.row_size(ggml_type, in_features)
