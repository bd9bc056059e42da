"""The kernels `engine.gpu.build` compiles ahead of time: one entry a kernel and specialization
(its constexprs, its pointers' element types), each naming its @triton.jit function by module and
name, so reading this table imports no triton. A kernel's launch wrapper finds its cubin by the
entry's name (`engine.gpu.launcher.CubinKernel.load(name)`).
"""

import math
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as QT

from engine.formats.int4 import AWQ
from engine.formats.int4 import FORMATS as INT4_FORMATS


@dataclass(frozen=True)
class KernelSpec:
    """One registered kernel: what `ASTSource` compiles, and how."""

    name: str  # the manifest key and the files' stem
    function: str  # "module:function" of the @triton.jit function
    signature: dict[str, str]  # every argument in order: "*fp32", "*u8", "i32", "fp32", "constexpr"
    constexprs: dict[str, int | float | bool] = field(default_factory=dict)
    aligned: tuple[str, ...] = ()  # arguments promised divisible by 16 (pointers: 16-byte aligned)
    num_warps: int = 4
    num_stages: int = 2
    exact_fp: bool = True  # enable_fp_fusion=False: no FMA contraction, the reference's rounding
    max_registers: int | None = None  # None: the build's budget (`--max-registers`, 128)


SMOKE = KernelSpec(
    name="smoke_scaled_add",
    function="engine.gpu.smoke:scaled_add_kernel",
    signature={
        "x_ptr": "*fp32",
        "y_ptr": "*fp32",
        "out_ptr": "*fp32",
        "n": "i32",
        "alpha": "fp32",
        "BLOCK": "constexpr",
    },
    constexprs={"BLOCK": 1024},
    aligned=("x_ptr", "y_ptr", "out_ptr"),
)


# more warps where four leave a thread too much live state: Q6_K's gate_up spilled on sm_80
_WARPS = {("moe_gate_up", "q6_k"): 8}
FIELD_ALIGN = 16  # bytes: what the K-quant kernels assume of pool rows and fields (their `aligned`)
# the GGML types engine.gpu.kquant_moe reads (engine.gpu.ggml_dots: one dot function each)
KQUANT_TYPES = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.IQ4_XS, QT.IQ4_NL, QT.MXFP4)
KQUANT_BLOCK_N = 8  # rows a program in the built kernels: their launch grids divide by it
KQUANT_DTYPES = ("fp32", "bf16")  # the activations' dtypes the kernels are built for


def kquant_name(kernel: str, ggml_type: int, x_dtype: str) -> str:
    """The registered name of `kernel` ("moe_gate_up", "moe_down", "quantized_gemv") for blocks of
    `ggml_type` and activations in `x_dtype` ("fp32", "bf16"): `CubinKernel.load`'s key."""
    return f"{kernel}_{QT(ggml_type).name.lower()}_{x_dtype}"


def kquant_specs(x_dtype: str = "fp32") -> tuple[KernelSpec, ...]:
    """engine.gpu.kquant_moe's kernels, one entry per kernel and GGML type (8 rows a program, as
    its JIT wrappers launch them): x, the routing weights and `moe_down`'s out in `x_dtype` (the
    kernel rounds its float32 sums once, as it stores them), act and the GEMV's out float32, the
    pool and the blocks bytes, the slot table and the top-k ids int64 (what the device cache and
    torch.topk give)."""
    ints = {"expert_nbytes": "i32", "field_offset": "i32"}
    kernels = {
        "moe_gate_up": {"x_ptr": f"*{x_dtype}", "pool_ptr": "*u8", "table_ptr": "*i64", "ids_ptr": "*i64"}
        | {"act_ptr": "*fp32", **ints, "inter": "i32", "hidden": "i32"},
        "moe_down": {"act_ptr": "*fp32", "pool_ptr": "*u8", "table_ptr": "*i64", "ids_ptr": "*i64"}
        | {
            "weights_ptr": f"*{x_dtype}",
            "out_ptr": f"*{x_dtype}",
            **ints,
            "hidden": "i32",
            "inter": "i32",
            "top_k": "i32",
        },
        "quantized_gemv": {"x_ptr": f"*{x_dtype}", "blocks_ptr": "*u8", "out_ptr": "*fp32"}
        | {"out_features": "i32", "in_features": "i32"},
    }
    return tuple(
        KernelSpec(
            name=kquant_name(kernel, ggml_type, x_dtype),
            function=f"engine.gpu.kquant_moe:{kernel}_kernel",
            signature=params | {"GGML_TYPE": "constexpr", "BLOCK_N": "constexpr"},
            constexprs={"GGML_TYPE": int(ggml_type), "BLOCK_N": KQUANT_BLOCK_N},
            aligned=tuple(name for name, kind in params.items() if kind.startswith("*")),
            num_warps=_WARPS.get((kernel, ggml_type.name.lower()), 4),
        )
        for kernel, params in kernels.items()
        for ggml_type in KQUANT_TYPES
    )


# the GGML types gpt-oss's experts come in (its release's MXFP4): `clamped_specs` builds theirs
CLAMPED_TYPES = (QT.MXFP4,)


def clamped_specs(x_dtype: str = "fp32") -> tuple[KernelSpec, ...]:
    """engine.gpu.kquant_moe's kernels for gpt-oss's experts (biases and its clamped gate) over
    `CLAMPED_TYPES`: `kquant_specs`' arguments plus each field's bias offset, and the gate's alpha
    and limit (float32)."""
    plain = {spec.name: spec for spec in kquant_specs(x_dtype)}
    specs = []
    for kernel, variant in (("moe_gate_up", "moe_gate_up_clamped"), ("moe_down", "moe_down_biased")):
        for ggml_type in CLAMPED_TYPES:
            base = plain[kquant_name(kernel, ggml_type, x_dtype)]
            signature = {}
            for name, kind in base.signature.items():
                if name in ("GGML_TYPE", "BLOCK_N"):
                    continue
                signature[name] = kind
                if name == "field_offset":
                    signature["bias_offset"] = "i32"
            if kernel == "moe_gate_up":
                signature |= {"alpha": "fp32", "limit": "fp32"}
            specs.append(
                KernelSpec(
                    name=kquant_name(variant, ggml_type, x_dtype),
                    function=f"engine.gpu.kquant_moe:{variant}_kernel",
                    signature=signature | {"GGML_TYPE": "constexpr", "BLOCK_N": "constexpr"},
                    constexprs=base.constexprs,
                    aligned=base.aligned,
                    num_warps=base.num_warps,
                )
            )
    return tuple(specs)


# engine.gpu.kquant_moe's fused MoE kernels, for float32 and bfloat16 activations
MOE_KERNELS: tuple[KernelSpec, ...] = tuple(
    spec for dtype in KQUANT_DTYPES for spec in (*kquant_specs(dtype), *clamped_specs(dtype))
)


# -- the standard decoder's one-token step: engine.gpu.decoder_kernels and engine.gpu.decode_attention --

DECODER_DTYPES = ("fp32", "bf16")  # the hidden states' (and KV cache's) dtypes they are built for
DECODER_HEAD_DIMS = (128,)  # head widths built (Qwen3-MoE, Mixtral, OLMoE, Qwen1.5-MoE, Phi-3.5-MoE)
NORM_BLOCK = 1024  # columns a norm program reads at a time (it loops over wider rows)
ATTENTION_BLOCK_H = 16  # query heads of one KV head a program (tl.dot's least rows; fewer masked)
ATTENTION_BLOCK_T = 32  # cached positions a step of a program's loop
ATTENTION_MAX_SPLITS = 64  # programs a KV head at most: the reduce kernel reads their partials at once
ATTENTION_WARPS = 8  # the split kernel's: with four, a thread holds too much of its tensor-core operands
MIN_SPLIT_POSITIONS = 4 * ATTENTION_BLOCK_T  # fewer positions a program would cost more to reduce
ROUTER_BLOCK_E = 512  # experts at most
ROUTER_MAX_K = 16  # top-k at most


def attention_splits(capacity: int) -> tuple[int, int]:
    """`(splits, split_len)` of the attention's launches for a cache of `capacity` positions: each KV
    head's positions in `splits` ≤ ATTENTION_MAX_SPLITS runs of `split_len` (a multiple of the loop's
    block, at least MIN_SPLIT_POSITIONS). From the capacity alone: the same launches at every length
    (here, not in `decode_attention`, so that the cubins' launches need no triton)."""
    per_split = max(MIN_SPLIT_POSITIONS, math.ceil(capacity / ATTENTION_MAX_SPLITS))
    split_len = math.ceil(per_split / ATTENTION_BLOCK_T) * ATTENTION_BLOCK_T
    return math.ceil(capacity / split_len), split_len


def _decoder_kernel(
    name: str, function: str, signature: dict[str, str], aligned: str, num_warps: int = 4, **constexprs
) -> KernelSpec:
    """An entry of the decoder's kernels; `aligned` names the arguments promised divisible by 16
    (the bulk tensors: torch allocates them so, and the launcher refuses a pointer that is not)."""
    return KernelSpec(
        name=name,
        function=function,
        signature=signature | dict.fromkeys(constexprs, "constexpr"),
        constexprs=constexprs,
        aligned=tuple(aligned.split()),
        num_warps=num_warps,
    )


def decoder_specs(dtype: str = "fp32") -> tuple[KernelSpec, ...]:
    """The norms and the router for hidden states, norm weights, router logits and routing weights
    in `dtype` ("fp32", "bf16"); the top-k ids int64. Names end in `_{dtype}`."""
    act, kernels = f"*{dtype}", "engine.gpu.decoder_kernels"
    norm = {
        "x_ptr": act,
        "residual_ptr": act,
        "weight_ptr": act,
        "out_ptr": act,
        "width": "i32",
        "eps": "fp32",
    }
    router = {"logits_ptr": act, "ids_ptr": "*i64", "weights_ptr": act, "experts": "i32"}
    router |= {"top_k": "i32", "renormalize": "i32"}
    rows = "x_ptr residual_ptr weight_ptr out_ptr width"
    return (
        *(
            _decoder_kernel(
                f"{'add_' if add else ''}rms_norm_{dtype}",
                f"{kernels}:rms_norm_kernel",
                norm,
                rows,
                ADD=add,
                BLOCK=NORM_BLOCK,
            )
            for add in (True, False)
        ),
        _decoder_kernel(
            f"router_top_k_{dtype}",
            f"{kernels}:router_top_k_kernel",
            router,
            "logits_ptr",
            BLOCK_E=ROUTER_BLOCK_E,
            MAX_K=ROUTER_MAX_K,
        ),
    )


def head_specs(dtype: str = "fp32", head_dim: int = 128) -> tuple[KernelSpec, ...]:
    """The per-head kernels (rotary and KV write, with and without q/k norms; the attention's two
    passes) for heads of `head_dim` in `dtype`, the position an int64 on the device, the attention's
    partials float32. Names end in `_d{head_dim}_{dtype}`."""
    act, kernels, attention = f"*{dtype}", "engine.gpu.decoder_kernels", "engine.gpu.decode_attention"
    rope = {"q_ptr": act, "k_ptr": act, "v_ptr": act, "q_norm_ptr": act, "k_norm_ptr": act}
    rope |= {"cos_ptr": act, "sin_ptr": act, "pos_ptr": "*i64", "q_out_ptr": act}
    rope |= {"key_cache_ptr": act, "value_cache_ptr": act, "heads": "i32", "kv_heads": "i32"}
    rope |= {"capacity": "i32", "table_rows": "i32", "eps": "fp32"}
    split = {"q_ptr": act, "key_cache_ptr": act, "value_cache_ptr": act, "pos_ptr": "*i64"}
    split |= {"partial_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "group": "i32"}
    split |= {"capacity": "i32", "split_len": "i32", "splits": "i32", "scaling": "fp32"}
    reduce = {"partial_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "out_ptr": act, "splits": "i32"}
    rope_rows = " ".join(name for name, kind in rope.items() if kind == act)  # not the position
    suffix = f"d{head_dim}_{dtype}"
    return (
        *(
            _decoder_kernel(
                f"rope_kv_write{'_qk_norm' if qk_norm else ''}_{suffix}",
                f"{kernels}:rope_kv_write_kernel",
                rope,
                rope_rows,
                QK_NORM=qk_norm,
                HEAD_DIM=head_dim,
            )
            for qk_norm in (False, True)
        ),
        _decoder_kernel(
            f"decode_attention_split_{suffix}",
            f"{attention}:decode_attention_split_kernel",
            split,
            "q_ptr key_cache_ptr value_cache_ptr partial_ptr",
            num_warps=ATTENTION_WARPS,
            HEAD_DIM=head_dim,
            BLOCK_H=ATTENTION_BLOCK_H,
            BLOCK_T=ATTENTION_BLOCK_T,
        ),
        _decoder_kernel(
            f"decode_attention_reduce_{suffix}",
            f"{attention}:decode_attention_reduce_kernel",
            reduce,
            "partial_ptr out_ptr",
            HEAD_DIM=head_dim,
            MAX_SPLITS=ATTENTION_MAX_SPLITS,
        ),
    )


# the decoder's kernels, for float32 and bfloat16 hidden states
DECODER_KERNELS: tuple[KernelSpec, ...] = tuple(
    spec
    for dtype in DECODER_DTYPES
    for spec in (*decoder_specs(dtype), *(s for d in DECODER_HEAD_DIMS for s in head_specs(dtype, d)))
)


# -- FP8 and int4 experts (engine.gpu.fp8_moe, engine.gpu.int4_moe) --------------------------------

FP8_BLOCK_N = INT4_BLOCK_N = 8  # rows a program in the built kernels: their launch grids divide by it
# the ints each family reads of its projection's fields, after the pool row's size
# (engine.gpu.projections: `ints`)
FP8_FIELD_INTS = ("field_offset", "scale_offset", "block_rows", "block_cols")
INT4_FIELD_INTS = ("field_offset", "qzeros_offset", "scales_offset", "g_idx_offset")
INT4_FIELD_INTS += ("part_rows", "group_size", "scales_bf16")
# (format, act order) of the int4 kernels built: AWQ has no g_idx
INT4_VARIANTS = tuple((fmt, act) for fmt in INT4_FORMATS for act in (False, True) if not (fmt == AWQ and act))
# warps a program: with four, a thread holds 16 of a chunk's 8 × 256 weights and several kernels
# (FP8's down, int4's GPTQ and act-order ones) need more than 128 registers on sm_80
FP8_INT4_WARPS = 8


def fp8_name(kernel: str, x_dtype: str) -> str:
    """The registered name of engine.gpu.fp8_moe's `kernel` for activations in `x_dtype`."""
    return f"{kernel}_fp8_{x_dtype}"


def int4_variant(fmt: str, act_order: bool) -> str:
    """`int4_<format>[_g_idx]`: words in `fmt` (one of engine.formats.int4.FORMATS), with act-order's
    g_idx or without."""
    slug = fmt.replace("compressed-tensors", "ct").replace("-", "_")
    return f"int4_{slug}{'_g_idx' if act_order else ''}"


def int4_name(kernel: str, fmt: str, act_order: bool, x_dtype: str) -> str:
    """The registered name of engine.gpu.int4_moe's `kernel` for `int4_variant(fmt, act_order)` and
    activations in `x_dtype`."""
    return f"{kernel}_{int4_variant(fmt, act_order)}_{x_dtype}"


def _routed_signatures(x_dtype: str, field_ints: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """`moe_gate_up`'s and `moe_down`'s arguments, their projection's `field_ints` between the pool
    row's size and the shape (as K-quants' `field_offset` lies there)."""
    ints = {"expert_nbytes": "i32"} | dict.fromkeys(field_ints, "i32")
    routed = {"pool_ptr": "*u8", "table_ptr": "*i64", "ids_ptr": "*i64"}
    return {
        "moe_gate_up": {"x_ptr": f"*{x_dtype}", **routed, "act_ptr": "*fp32"}
        | ints
        | {"inter": "i32", "hidden": "i32"},
        "moe_down": {"act_ptr": "*fp32", **routed, "weights_ptr": f"*{x_dtype}", "out_ptr": f"*{x_dtype}"}
        | ints
        | {"hidden": "i32", "inter": "i32", "top_k": "i32"},
    }


def _spec(name: str, function: str, params: dict[str, str], constexprs: dict) -> KernelSpec:
    return KernelSpec(
        name=name,
        function=function,
        signature=params | dict.fromkeys(constexprs, "constexpr"),
        constexprs=constexprs,
        aligned=tuple(arg for arg, kind in params.items() if kind.startswith("*")),
        num_warps=FP8_INT4_WARPS,
    )


def fp8_specs(x_dtype: str = "fp32") -> tuple[KernelSpec, ...]:
    """engine.gpu.fp8_moe's kernels for activations in `x_dtype`: the routed pair and the GEMV (the
    e4m3 bytes `*u8`, their scales `*fp32`); the block of the scales is an argument."""
    kernels = _routed_signatures(x_dtype, FP8_FIELD_INTS) | {
        "quantized_gemv": {"x_ptr": f"*{x_dtype}", "weights_ptr": "*u8", "scales_ptr": "*fp32"}
        | {"out_ptr": "*fp32", "out_features": "i32", "in_features": "i32"}
        | {"block_rows": "i32", "block_cols": "i32"}
    }
    return tuple(
        _spec(
            fp8_name(kernel, x_dtype), f"engine.gpu.fp8_moe:{kernel}_kernel", params, {"BLOCK_N": FP8_BLOCK_N}
        )
        for kernel, params in kernels.items()
    )


def int4_specs(x_dtype: str = "fp32") -> tuple[KernelSpec, ...]:
    """engine.gpu.int4_moe's routed pair for activations in `x_dtype`, one per format and act order
    (INT4_VARIANTS: their `FORMAT` is the format's index in engine.formats.int4.FORMATS)."""
    return tuple(
        _spec(
            int4_name(kernel, fmt, act_order, x_dtype),
            f"engine.gpu.int4_moe:{kernel}_kernel",
            params,
            {"FORMAT": INT4_FORMATS.index(fmt), "ACT_ORDER": act_order, "BLOCK_N": INT4_BLOCK_N},
        )
        for kernel, params in _routed_signatures(x_dtype, INT4_FIELD_INTS).items()
        for fmt, act_order in INT4_VARIANTS
    )


# engine.gpu.fp8_moe's and engine.gpu.int4_moe's kernels, for float32 and bfloat16 activations
FP8_INT4_KERNELS: tuple[KernelSpec, ...] = tuple(
    spec for dtype in KQUANT_DTYPES for spec in (*fp8_specs(dtype), *int4_specs(dtype))
)

REGISTRY: tuple[KernelSpec, ...] = (SMOKE, *MOE_KERNELS, *FP8_INT4_KERNELS, *DECODER_KERNELS)
