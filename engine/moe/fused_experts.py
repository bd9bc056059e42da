"""One token's routed experts through the fused kernels (`engine.gpu.kquant_moe`): two launches a layer.

With every expert on the device (`ExpertCache.holds_all`), a one-token step looks its experts up in
the layer's slot table on the device (`batched_experts.forward_resident`). In torch that is a
gather, each field dequantized, two batched matmuls and a sum: some 55 kernels a layer for a
Q4_K_M file. The fused kernels read the slot table, the token's top-k ids and the experts' GGUF
blocks in the cache's pool themselves: `moe_gate_up` (silu(gate) · up of each of the K experts, into
a float32 buffer the layer keeps) and `moe_down` (Σ_k w_k · down_k @ act_k, rounded once into the
output, in the hidden state's dtype). Two launches and one allocation a layer, nothing read on the
host, the same launches whatever the route: a CUDA graph (`moe.cuda_graphs`) captures them as it
captures the torch path.

`FusedExperts.of(module)` decides once per layer, at its first such step (`OffloadedExperts.fused`),
whether they apply: the experts' `gate_up_proj` and `down_proj` are ggml blocks as the store keeps
them (`engine.gpu.registry.KQUANT_TYPES`: Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS, IQ4_NL or MXFP4; not
repacked for the CPU), the experts gate as SwiGLU (gate rows first) with no biases, and the routing
weight does not scale their input; and whether the kernels run: on
CUDA, their cubins load (`engine.gpu.launcher`; built for float32 and bfloat16 activations, another
dtype is computed in float32, cast before and after); on the CPU only when asked
(`ExpertControl.fused = True`), through Triton's JIT in its interpreter (`TRITON_INTERPRET=1`
before triton is imported) — for tests and for counting a step's launches, not for speed. Where
they do not apply the reason is logged once, and the torch path runs.

Numerics: each weight is dequantized with `gguf.blocks.dequantize`'s float32 operations and the dot
products accumulate in float32 in the kernels' order, not a BLAS matmul's: float32 outputs agree with
the torch path's to ~1e-6 of their scale. In bfloat16 the kernels round once, where the torch path
rounds the dequantized weights and each matmul's output.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as QT

from engine.formats.fields import GgmlBlocks
from engine.formats.layout import ExpertField
from engine.gpu.registry import FIELD_ALIGN, KQUANT_BLOCK_N, KQUANT_TYPES, kquant_name

log = logging.getLogger(__name__)

INTERPRETED_BLOCK_N = 512  # rows a program in Triton's interpreter: its time goes by programs, not rows
CUBIN_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # the built kernels' activations
_KQUANT_NAMES = ", ".join(QT(t).name for t in KQUANT_TYPES)


@dataclass(frozen=True)
class Projection:
    """One projection of every expert: where it lies in a pool row, its blocks and its weight's shape."""

    offset: int
    ggml_type: int
    rows: int
    columns: int


def unfit(module) -> str | None:
    """Why the fused kernels cannot compute `module`'s experts (an `OffloadedExperts`) as it holds
    them, or run where it runs; None where they can. The family's gate is probed last, where all
    else fits (a few operators on the CPU, once)."""
    reason = _unfit_layout(module) or _not_asked(module.cache.device, module.control.fused)
    if reason is None and not module.swiglu_in_ggml:
        reason = "the experts do not gate as SwiGLU (silu(gate) · up, gate rows first)"
    return reason


def _unfit_layout(module) -> str | None:
    if module.scales_input:
        return "the routing weight scales each expert's input"
    if module.has_bias:
        return "the experts have biases"
    layout = module.cache.store.layout_of(module.layer)
    names = sorted(f.name for f in layout.fields)
    if layout.quant is not None or names != ["down_proj", "gate_up_proj"]:
        return f"the experts hold {', '.join(names)} ({layout.format_name}), not gate_up_proj and down_proj"
    for field in layout.fields:
        if (reason := _unfit_field(field)) is not None:
            return reason
    if layout.nbytes % FIELD_ALIGN:
        return f"an expert's {layout.nbytes} bytes are not a multiple of {FIELD_ALIGN}"
    return None


def _unfit_field(field: ExpertField) -> str | None:
    if not isinstance(field.format, GgmlBlocks):
        return f"{field.name} is {field.format.label}, not GGUF blocks"
    if field.packing is not None:
        return f"{field.name} is repacked for the CPU's kernels ({field.packing})"
    if field.ggml_type not in KQUANT_TYPES:
        return f"{field.name} is {field.format.label}: the fused kernels read {_KQUANT_NAMES}"
    if field.offset % FIELD_ALIGN:
        return f"{field.name} does not start on a {FIELD_ALIGN}-byte boundary"
    return None


class FusedExperts:
    """The fused kernels of one layer's experts (see the module doc): `__call__` is
    `batched_experts.forward_resident`'s contract."""

    def __init__(self, cache, gate_up: Projection, down: Projection, kernels: _Cubins | _Interpreted):
        self.cache = cache  # its pool is read at each call: a resize allocates another
        self.gate_up, self.down, self.kernels = gate_up, down, kernels
        self._act: torch.Tensor | None = None  # [K, I] float32: gate_up's output, down's input

    @classmethod
    def of(cls, module) -> FusedExperts | None:
        """The fused kernels of `module` (an `OffloadedExperts`), or None (the reason logged once)."""
        chosen = cls.choose(module)
        if isinstance(chosen, str):
            _log_once(chosen)
            return None
        return chosen

    @classmethod
    def choose(cls, module) -> FusedExperts | str:
        """The fused kernels of `module`, or why they do not apply."""
        if (reason := unfit(module)) is not None:
            return reason
        fields = {f.name: f for f in module.cache.store.layout_of(module.layer).fields}
        gate_up, down = (
            Projection(f.offset, f.ggml_type, *f.format.shape)
            for f in (fields["gate_up_proj"], fields["down_proj"])
        )
        device = module.cache.device
        kernels = _Cubins.load(gate_up, down, device) if device.type == "cuda" else _Interpreted.load()
        return kernels if isinstance(kernels, str) else cls(module.cache, gate_up, down, kernels)

    def __call__(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """`hidden [1, H]`'s experts `top_k_index [1, K]` (their slots in `table [E]`), weighted by
        `top_k_weights [1, K]` and summed: `[1, H]` in `hidden`'s dtype. Reads nothing on the host."""
        dtype = hidden.dtype if hidden.dtype in self.kernels.dtypes else torch.float32
        x, weights = _operand(hidden, dtype), _operand(top_k_weights, dtype)
        ids = _operand(top_k_index, torch.int64)
        act = self._act_for(top_k_index.shape[-1], hidden.device)
        pool = self.cache.pool
        self.kernels.gate_up(x, pool, table, ids, act, self.gate_up)
        out = torch.empty(1, self.down.rows, dtype=dtype, device=hidden.device)
        self.kernels.down(act, pool, table, ids, weights, out, self.down)
        return out if dtype == hidden.dtype else out.to(hidden.dtype)

    def _act_for(self, top_k: int, device: torch.device) -> torch.Tensor:
        """The layer's `[K, I]` buffer between the two kernels (allocated once: the layers run one at
        a time on one stream, and a CUDA graph keeps reading the one it captured)."""
        act = self._act
        if act is None or act.shape[0] != top_k or act.device != device:
            act = self._act = torch.empty(top_k, self.gate_up.rows // 2, dtype=torch.float32, device=device)
        return act


def _operand(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as the kernels read it: in `dtype`, contiguous, 16-byte aligned (no copy where it is)."""
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if not tensor.is_contiguous() or tensor.data_ptr() % FIELD_ALIGN:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def _not_asked(device: torch.device, asked: bool | None) -> str | None:
    """Why no fused kernels run on `device` as `ExpertControl.fused` asks (`asked`), or None."""
    if asked is False:
        return "turned off (ExpertControl.fused is False)"
    if device.type not in ("cuda", "cpu"):
        return f"no fused kernels run on {device.type}"
    if device.type == "cpu" and not asked:
        return "on the CPU only when asked (ExpertControl.fused = True: Triton's interpreter)"
    return None


@functools.cache
def _log_once(reason: str) -> None:
    log.info("The fused expert kernels do not apply (%s): one-token steps compute in torch", reason)


def _blocks_of(rows: int) -> int:
    return -(-rows // KQUANT_BLOCK_N)


@functools.cache
def _cubin(name: str, device: int):
    """The cubin kernel `name` loaded on `device`, once for every layer that launches it."""
    from engine.gpu.launcher import CubinKernel

    return CubinKernel.load(name, device=device)


class _Cubins:
    """The kernels built ahead of time (`engine.gpu.launcher.CubinKernel`), a pair per dtype."""

    def __init__(self, kernels: dict[tuple[str, torch.dtype], object]):
        self.kernels = kernels
        self.dtypes = tuple(CUBIN_DTYPES)

    @classmethod
    def load(cls, gate_up: Projection, down: Projection, device: torch.device) -> _Cubins | str:
        index = torch.cuda.current_device() if device.index is None else device.index
        if index != torch.cuda.current_device():
            return f"the experts are on cuda:{index}, not the current device"
        kernels = {}
        try:
            for dtype, name in CUBIN_DTYPES.items():
                for kernel, projection in (("moe_gate_up", gate_up), ("moe_down", down)):
                    cubin = kquant_name(kernel, projection.ggml_type, name)
                    kernels[kernel, dtype] = _cubin(cubin, index)
        except (RuntimeError, OSError) as err:
            return f"their cubins do not load: {err}"
        return cls(kernels)

    def gate_up(self, x, pool, table, ids, act, p: Projection) -> None:
        kernel, nbytes, inter = self.kernels["moe_gate_up", x.dtype], pool.shape[1], p.rows // 2
        args = (x, pool, table, ids, act, nbytes, p.offset, inter, p.columns)
        kernel((_blocks_of(inter), ids.numel()), *args)

    def down(self, act, pool, table, ids, weights, out, p: Projection) -> None:
        kernel, nbytes, top_k = self.kernels["moe_down", out.dtype], pool.shape[1], ids.numel()
        args = (act, pool, table, ids, weights, out, nbytes, p.offset, p.rows, p.columns, top_k)
        kernel((_blocks_of(p.rows),), *args)


class _Interpreted:
    """`engine.gpu.kquant_moe`'s JIT wrappers in Triton's interpreter (CPU tensors), for the dtypes
    the cubins take: a CPU run goes CUDA's way."""

    dtypes = tuple(CUBIN_DTYPES)

    def __init__(self, kquant_moe):
        self.kq = kquant_moe

    @classmethod
    def load(cls) -> _Interpreted | str:
        try:
            from triton.runtime.interpreter import InterpretedFunction

            from engine.gpu import kquant_moe
        except ImportError as err:
            return f"triton is not installed ({err})"
        if not isinstance(kquant_moe.moe_gate_up_kernel, InterpretedFunction):
            return "Triton's interpreter is off (TRITON_INTERPRET=1 before triton is first imported)"
        return cls(kquant_moe)

    def gate_up(self, x, pool, table, ids, act, p: Projection) -> None:
        kind, block_n = p.ggml_type, INTERPRETED_BLOCK_N
        self.kq.moe_gate_up(x, pool, table, ids, p.offset, kind, p.rows, p.columns, block_n, act=act)

    def down(self, act, pool, table, ids, weights, out, p: Projection) -> None:
        kind, block_n = p.ggml_type, INTERPRETED_BLOCK_N
        self.kq.moe_down(act, pool, table, ids, weights, p.offset, kind, p.rows, p.columns, block_n, out=out)
