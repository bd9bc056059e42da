"""One token's routed experts through the fused kernels (`engine.gpu`): two launches a layer.

With every expert on the device (`ExpertCache.holds_all`), a one-token step looks its experts up in
the layer's slot table on the device (`batched_experts.forward_resident`). In torch that is a
gather, each field dequantized, two batched matmuls and a sum: some 55 kernels a layer for a
Q4_K_M file. The fused kernels read the slot table, the token's top-k ids and the experts' bytes in
the cache's pool themselves: `moe_gate_up` (silu(gate) · up of each of the K experts, into a
float32 buffer the layer keeps) and `moe_down` (Σ_k w_k · down_k @ act_k, rounded once into the
output, in the hidden state's dtype). Two launches and one allocation a layer, nothing read on the
host, the same launches whatever the route: a CUDA graph (`moe.cuda_graphs`) captures them as it
captures the torch path.

Each projection goes to the kernel family of its stored type (`engine.gpu.projections`, one object
a type): GGUF blocks as the store keeps them (`gpu.kquant_moe`: Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS,
IQ4_NL, MXFP4; not repacked for the CPU), FP8 values with their block, row or tensor scales
(`gpu.fp8_moe`), GPTQ, AWQ and compressed-tensors int4 words with their zeros, scales and
act-order's g_idx (`gpu.int4_moe`).
Every family takes its fields as one run of ints, so a launch reads the same for every type.

`FusedExperts.of(module)` decides once per layer, at its first such step (`OffloadedExperts.fused`),
whether they apply: the experts hold `gate_up_proj` and `down_proj` in stored types a family reads,
gate as SwiGLU (gate rows first) with no biases — or as gpt-oss's experts (`ClampedGate`: a bias
on each projection, its clamped SwiGLU on interleaved gate and up rows; `moe_gate_up_clamped` and
`moe_down_biased`, built for its MXFP4 blocks) — and the routing weight does not scale their input;
and whether the kernels run: on CUDA, their cubins load (`engine.gpu.launcher`; built for float32
and bfloat16 activations, another dtype is computed in float32, cast before and after); on the CPU
only when asked (`ExpertControl.fused = True`), through Triton's JIT in its interpreter
(`TRITON_INTERPRET=1` before triton is imported), with the cubins' arguments — for tests and for
counting a step's launches, not for speed. Where they do not apply the reason is logged once, and
the torch path runs.

Numerics: each weight is dequantized with its format's reference float32 operations
(`gguf.blocks.dequantize`, `formats.fp8.dequantize`, `formats.int4.dequantize`) and the dot
products accumulate in float32 in the kernels' order, not a BLAS matmul's: float32 outputs agree
with the torch path's to ~1e-6 of their scale. In bfloat16 the kernels round once, where the torch
path rounds the dequantized weights and each matmul's output.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from engine.formats.fields import PLAIN
from engine.formats.layout import ExpertLayout
from engine.gpu.launch_ranges import launch_range
from engine.gpu.projections import Projection, projection
from engine.gpu.registry import CLAMPED_TYPES, FIELD_ALIGN

log = logging.getLogger(__name__)

INTERPRETED_BLOCK_N = 512  # rows a program in Triton's interpreter: its time goes by programs, not rows
CUBIN_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # the built kernels' activations
PROJECTIONS = ("gate_up_proj", "down_proj")
KERNELS = {"gate_up_proj": "moe_gate_up", "down_proj": "moe_down"}  # the kernel of each projection
BIASES = tuple(f"{name}_bias" for name in PROJECTIONS)
CLAMPED = {"moe_gate_up": "moe_gate_up_clamped", "moe_down": "moe_down_biased"}  # gpt-oss's kernels


@dataclass(frozen=True)
class ClampedGate:
    """gpt-oss's experts as its kernels read them: each projection's bias at its byte offset in a
    pool row (in `dtype`, the activations'), and the gate's `alpha` and `limit`."""

    gate_up_bias: int
    down_bias: int
    dtype: torch.dtype
    alpha: float
    limit: float

    @classmethod
    def of(cls, module, layout: ExpertLayout, found: dict[str, Projection]) -> ClampedGate | str:
        """`module`'s gate and biases, or why its biased experts are not gpt-oss's as built."""
        gate = _clamped_swiglu(getattr(module, "template", None))
        if gate is None:
            return "the experts have biases, and their gate is not gpt-oss's clamped SwiGLU"
        names = ", ".join(GGMLQuantizationType(t).name for t in CLAMPED_TYPES)
        for p in found.values():
            if getattr(p, "ggml_type", None) not in CLAMPED_TYPES:
                return f"gpt-oss's gate is built for {names} experts, not {p.label}"
        fields = {f.name: f for f in layout.fields}
        biases = [fields.get(name) for name in BIASES]
        if any(b is None or b.format is not PLAIN for b in biases) or biases[0].dtype != biases[1].dtype:
            return f"the experts' biases are not plain {' and '.join(BIASES)} of one dtype"
        if biases[0].dtype not in CUBIN_DTYPES:
            return f"the experts' biases are {biases[0].dtype}: the kernels read float32 and bfloat16"
        return cls(biases[0].offset, biases[1].offset, biases[0].dtype, *gate)


def _clamped_swiglu(template) -> tuple[float, float] | None:
    """`(alpha, limit)` where the family's gate is gpt-oss's, asked of its own `_apply_gate` on a
    probe reaching past the limit: gate and up interleaved, gate capped at the limit, up clamped to
    ±limit, (up + 1) · gate · sigmoid(alpha · gate)."""
    alpha, limit = getattr(template, "alpha", None), getattr(template, "limit", None)
    if not isinstance(alpha, float) or not isinstance(limit, float) or not hasattr(template, "_apply_gate"):
        return None
    probe = torch.linspace(-3 * limit, 3 * limit, 32).view(2, 16)
    gate, up = probe[..., ::2].clamp(max=limit), probe[..., 1::2].clamp(-limit, limit)
    want = (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return (alpha, limit) if torch.equal(template._apply_gate(probe), want) else None


def projections(module) -> dict[str, Projection] | str:
    """`module`'s (an `OffloadedExperts`) projections by kernel, as the fused kernels read them from
    the store's layout, or why they cannot compute its experts as it holds them."""
    if module.scales_input:
        return "the routing weight scales each expert's input"
    layout = module.cache.store.layout_of(module.layer)
    names = [name for name in _weight_names(layout) if not (module.has_bias and name in BIASES)]
    if layout.quant is not None or names != sorted(PROJECTIONS):
        return f"the experts hold {', '.join(names)} ({layout.format_name}), not gate_up_proj and down_proj"
    found = {KERNELS[name]: projection(layout, name) for name in PROJECTIONS}
    reasons = [p for p in found.values() if isinstance(p, str)]
    if reasons:
        return reasons[0]
    if layout.nbytes % FIELD_ALIGN:
        return f"an expert's {layout.nbytes} bytes are not a multiple of {FIELD_ALIGN}"
    return found


def _weight_names(layout: ExpertLayout) -> list[str]:
    """The fields that give a weight, sorted: every field but its formats' companions (scales …)."""
    taken = {name for f in layout.fields for name in f.format.companions(f.name)}
    return sorted(f.name for f in layout.fields if f.name not in taken)


class FusedExperts:
    """The fused kernels of one layer's experts (see the module doc): `__call__` is
    `batched_experts.forward_resident`'s contract."""

    def __init__(
        self,
        cache,
        gate_up: Projection,
        down: Projection,
        kernels: _Cubins | _Interpreted,
        gate: ClampedGate | None = None,
    ):
        self.cache = cache  # its pool is read at each call: a resize allocates another
        self.gate_up, self.down, self.kernels, self.gate = gate_up, down, kernels, gate
        self.names = KERNELS if gate is None else {p: CLAMPED[k] for p, k in KERNELS.items()}
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
        """The fused kernels of `module`, or why they do not apply. The family's gate is probed
        last, where all else fits (a few operators on the CPU, once)."""
        found, device = projections(module), module.cache.device
        if isinstance(found, str):
            return found
        if (reason := _not_asked(device, module.control.fused)) is not None:
            return reason
        gate = None
        if module.has_bias:
            gate = ClampedGate.of(module, module.cache.store.layout_of(module.layer), found)
            if isinstance(gate, str):
                return gate
        elif not module.swiglu_in_ggml:
            return "the experts do not gate as SwiGLU (silu(gate) · up, gate rows first)"
        gate_up, down = found["moe_gate_up"], found["moe_down"]
        named = found if gate is None else {CLAMPED[kernel]: p for kernel, p in found.items()}
        kernels = _Cubins.load(named, device) if device.type == "cuda" else _Interpreted.load(named)
        if isinstance(kernels, str):
            return kernels
        return cls(module.cache, gate_up, down, kernels, gate)

    def __call__(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        table: torch.Tensor,
    ) -> torch.Tensor:
        """`hidden [1, H]`'s experts `top_k_index [1, K]` (their slots in `table [E]`), weighted by
        `top_k_weights [1, K]` and summed: `[1, H]` in `hidden`'s dtype. Reads nothing on the host."""
        gate = self.gate
        dtype = hidden.dtype if hidden.dtype in self.kernels.dtypes else torch.float32
        dtype = dtype if gate is None else gate.dtype  # the biases are read in the activations' dtype
        x, weights = _operand(hidden, dtype), _operand(top_k_weights, dtype)
        ids = _operand(top_k_index, torch.int64)
        top_k, pool, gate_up, down = ids.numel(), self.cache.pool, self.gate_up, self.down
        act, inter = self._act_for(top_k, hidden.device), gate_up.rows // 2
        up_ints, down_ints, gate_args = gate_up.ints, down.ints, ()
        if gate is not None:
            up_ints, down_ints = (*up_ints, gate.gate_up_bias), (*down_ints, gate.down_bias)
            gate_args = (gate.alpha, gate.limit)
        self.kernels.launch(
            self.names["gate_up_proj"], gate_up, dtype, inter, top_k,
            x, pool, table, ids, act, pool.shape[1], *up_ints, inter, gate_up.columns, *gate_args,
        )  # fmt: skip
        out = torch.empty(1, down.rows, dtype=dtype, device=hidden.device)
        self.kernels.launch(
            self.names["down_proj"], down, dtype, down.rows, 1,
            act, pool, table, ids, weights, out, pool.shape[1], *down_ints, down.rows, down.columns, top_k,
        )  # fmt: skip
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


@functools.cache
def _cubin(name: str, device: int):
    """The cubin kernel `name` loaded on `device`, once for every layer that launches it."""
    from engine.gpu.launcher import CubinKernel

    return CubinKernel.load(name, device=device)


class _Cubins:
    """The kernels built ahead of time (`engine.gpu.launcher.CubinKernel`), a pair per dtype."""

    dtypes = tuple(CUBIN_DTYPES)

    def __init__(self, kernels: dict[tuple[str, torch.dtype], object]):
        self.kernels = kernels

    @classmethod
    def load(cls, found: dict[str, Projection], device: torch.device) -> _Cubins | str:
        index = torch.cuda.current_device() if device.index is None else device.index
        if index != torch.cuda.current_device():
            return f"the experts are on cuda:{index}, not the current device"
        kernels = {}
        try:
            for dtype, name in CUBIN_DTYPES.items():
                for kernel, p in found.items():
                    kernels[kernel, dtype] = _cubin(p.cubin(kernel, name), index)
        except (RuntimeError, OSError) as err:
            return f"their cubins do not load: {err}"
        return cls(kernels)

    def launch(self, kernel: str, p: Projection, dtype: torch.dtype, rows: int, programs: int, *args) -> None:
        """`kernel` on `rows` rows of `p`, `programs` programs a block of `p.block_n` rows."""
        self.kernels[kernel, dtype]((-(-rows // p.block_n), programs), *args)


class _Interpreted:
    """The families' JIT kernels (`p.module`) in Triton's interpreter (CPU tensors), launched with
    the cubins' arguments, for the dtypes the cubins take: a CPU run goes CUDA's way."""

    dtypes = tuple(CUBIN_DTYPES)

    def __init__(self, modules: dict[str, object]):
        self.modules = modules  # kernel → its family's module

    @classmethod
    def load(cls, found: dict[str, Projection]) -> _Interpreted | str:
        try:
            from triton.runtime.interpreter import InterpretedFunction

            modules = {kernel: importlib.import_module(p.module) for kernel, p in found.items()}
        except ImportError as err:
            return f"triton is not installed ({err})"
        if not all(isinstance(getattr(m, f"{k}_kernel"), InterpretedFunction) for k, m in modules.items()):
            return "Triton's interpreter is off (TRITON_INTERPRET=1 before triton is first imported)"
        return cls(modules)

    def launch(self, kernel: str, p: Projection, dtype: torch.dtype, rows: int, programs: int, *args) -> None:
        module = self.modules[kernel]
        grid = (-(-rows // INTERPRETED_BLOCK_N), programs)
        with launch_range(f"{kernel}_{p.label}"):
            getattr(module, f"{kernel}_kernel")[grid](
                *args, **p.constexprs, BLOCK_N=INTERPRETED_BLOCK_N, **module.LAUNCH
            )
