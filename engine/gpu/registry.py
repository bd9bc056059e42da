"""The kernels `engine.gpu.build` compiles ahead of time: one entry a kernel and specialization
(its constexprs, its pointers' element types), each naming its @triton.jit function by module and
name, so reading this table imports no triton. A kernel's launch wrapper finds its cubin by the
entry's name (`engine.gpu.launcher.CubinKernel.load(name)`).
"""

from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as QT


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


def kquant_specs(x_dtype: str = "fp32") -> tuple[KernelSpec, ...]:
    """engine.gpu.kquant_moe's kernels, one entry per kernel and GGML type (8 rows a program, as
    its JIT wrappers launch them): x, act, weights and out in `x_dtype`, the pool and the blocks
    bytes, the slot table and the top-k ids int64 (what the device cache and torch.topk give)."""
    ints = {"expert_nbytes": "i32", "field_offset": "i32"}
    kernels = {
        "moe_gate_up": {"x_ptr": f"*{x_dtype}", "pool_ptr": "*u8", "table_ptr": "*i64", "ids_ptr": "*i64"}
        | {"act_ptr": "*fp32", **ints, "inter": "i32", "hidden": "i32"},
        "moe_down": {"act_ptr": "*fp32", "pool_ptr": "*u8", "table_ptr": "*i64", "ids_ptr": "*i64"}
        | {
            "weights_ptr": f"*{x_dtype}",
            "out_ptr": "*fp32",
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
            name=f"{kernel}_{ggml_name}_{x_dtype}",
            function=f"engine.gpu.kquant_moe:{kernel}_kernel",
            signature=params | {"GGML_TYPE": "constexpr", "BLOCK_N": "constexpr"},
            constexprs={"GGML_TYPE": int(ggml_type), "BLOCK_N": 8},
            aligned=tuple(name for name, kind in params.items() if kind.startswith("*")),
            num_warps=_WARPS.get((kernel, ggml_name), 4),
        )
        for kernel, params in kernels.items()
        for ggml_name, ggml_type in (("q4_k", QT.Q4_K), ("q6_k", QT.Q6_K), ("q8_0", QT.Q8_0))
    )


# engine.gpu.kquant_moe's fused MoE kernels (add `*kquant_specs("bf16")` for bfloat16 activations)
MOE_KERNELS: tuple[KernelSpec, ...] = kquant_specs("fp32")

REGISTRY: tuple[KernelSpec, ...] = (SMOKE, *MOE_KERNELS)
