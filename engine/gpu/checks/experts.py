"""The routed experts' and the quantized GEMVs' cases (`case.Case`), for every stored type the fused
kernels read: GGUF blocks (`kquant_moe`), FP8 values with 128 × 128 or whole-matrix scales
(`fp8_moe`), int4 words in each built variant (`int4_moe`); and gpt-oss's MXFP4 experts with their
biases and clamped gate (`kquant_moe`'s `moe_gate_up_clamped`, `moe_down_biased`).

A type's experts are laid out by its own `ExpertLayout`, as the store lays them out, in shuffled
rows of a pool whose other rows hold random bytes; the launches pass what `engine.moe.fused_experts`
passes (the projection's ints, `engine.gpu.projections`). The reference: each routed expert's
weights as its format dequantizes them (`gguf.blocks.dequantize`, `fp8.dequantize`,
`int4.dequantize`), in float64 → silu(gate) · up; Σ_k w_k · down_k of the kernel's own act, so that
the down kernel is judged alone. The timed launches route the pool's other rows in turn
(`Shapes.timing_bytes` of them), as a step's layers read other experts. `random_blocks` makes the
valid random blocks both these checks and the interpreter tests use.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from engine.formats import fp8, int4
from engine.formats.fields import GgmlBlocks, GgmlWeight
from engine.formats.fp8 import FP8_DTYPE, Fp8Weight, scale_shape
from engine.formats.fp8_experts import fp8_layout
from engine.formats.gguf import blocks
from engine.formats.gguf.blocks import TYPES, row_bytes
from engine.formats.int4_experts import int4_layout
from engine.formats.layout import ExpertField, ExpertLayout
from engine.gpu.checks.case import DTYPES, Case, Launch, Shapes, merged
from engine.gpu.projections import projection
from engine.gpu.registry import FP8_BLOCK_N, KQUANT_BLOCK_N, fp8_name, kquant_name

FP8_SCALES = ("block-128", "per-tensor")  # the FP8 cases: 128 × 128 blocks, one scale a matrix
ROUTED = ("moe_gate_up", "moe_down")
CLAMPED = ("moe_gate_up_clamped", "moe_down_biased")  # gpt-oss's experts' kernels
BIASES = ("gate_up_proj_bias", "down_proj_bias")
GPT_OSS_GATE = (1.702, 7.0)  # its swiglu_alpha and swiglu_limit


def random_blocks(ggml_type: QT, rows: int, columns: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 `[rows, row bytes]`: random codes and scales, float16 fields and MXFP4's e8m0 exponents
    finite and of moderate size (so that every block counts in the sums), a few of them subnormal."""
    traits = TYPES[ggml_type]
    data = rng.integers(0, 256, (rows, row_bytes(ggml_type, columns)), dtype=np.uint8)
    block_rows = data.reshape(-1, traits.block_bytes)
    start = 0
    for field in traits.fields:
        if field.kind == "f16":
            count = (len(block_rows), 1)
            values = rng.standard_normal(count) * np.exp2(rng.integers(-12, -5, count))
            values[::97] = 3e-6  # a float16 subnormal
            block_rows[:, start : start + 2] = values.astype(np.float16).view(np.uint8)
        elif ggml_type == QT.MXFP4 and field.name == "e":  # scales 2^(e − 128), as the f16 ones
            exponents = rng.integers(116, 124, len(block_rows))
            exponents[::97], exponents[1::97] = 0, 1  # float32 subnormal scales
            block_rows[:, start] = exponents
        start += field.nbytes
    return torch.from_numpy(data)


def random_codes(rng: np.random.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """uint8 e4m3 values, every byte but NaN's (subnormals too)."""
    codes = torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8))
    return torch.where(codes & 0x7F == 0x7F, 0x3F, codes)  # S.1111.111 is NaN


def random_scales(rng: np.random.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy((rng.random(shape) * 0.02 + 1e-3).astype(np.float32))


def fill(weight, rng: np.random.Generator) -> None:
    """One weight's view in a pool row filled with valid random values of its format."""
    if isinstance(weight, GgmlWeight):
        weight.data.copy_(random_blocks(QT(weight.ggml_type), *weight.shape, rng))
    elif isinstance(weight, Fp8Weight):
        weight.data.view(torch.uint8).copy_(random_codes(rng, tuple(weight.data.shape)))
        weight.scale_inv.copy_(random_scales(rng, tuple(weight.scale_inv.shape)))
    elif isinstance(weight, torch.Tensor):  # a bias: large enough to reach past gpt-oss's limit
        weight.copy_(normal(rng, *weight.shape).mul(4.0))
    else:  # int4 words: every nibble; scales of moderate size; act-order's groups permuted
        for words in (weight.qweight, weight.qzeros):
            drawn = rng.integers(-(2**31), 2**31, tuple(words.shape), dtype=np.int64)
            words.copy_(torch.from_numpy(drawn.astype(np.int32)))
        weight.scales.copy_(random_scales(rng, tuple(weight.scales.shape)).to(weight.scales.dtype))
        if weight.g_idx is not None:  # each stacked matrix its own permutation of the groups
            inputs = weight.shape[1]
            plain = np.arange(inputs) // (inputs // int4.groups(weight))
            rows = [rng.permutation(plain) for _ in range(weight.g_idx.shape[0])]
            weight.g_idx.copy_(torch.from_numpy(np.stack(rows).astype(np.int32)))


def dequantized(weight) -> torch.Tensor:
    """float32 `[out, in]`: the weight as its format's reference dequantizes it."""
    if isinstance(weight, GgmlWeight):
        return blocks.dequantize(weight.data, weight.ggml_type, weight.shape, torch.float32)
    if isinstance(weight, Fp8Weight):
        return fp8.dequantize(weight)
    return int4.dequantize(weight)


def _weights(shapes: Shapes) -> dict[str, tuple[int, int]]:
    """The routed projections' `(out, in)`: gate rows, then up rows; down."""
    return {"gate_up_proj": (2 * shapes.inter, shapes.hidden), "down_proj": (shapes.hidden, shapes.inter)}


def kquant_layout(ggml_type: QT, shapes: Shapes) -> ExpertLayout:
    """Both projections in blocks of `ggml_type`, as `engine.formats.gguf.experts` lays them out."""
    return ExpertLayout.placed(
        ExpertField(
            name, (rows, row_bytes(ggml_type, cols)), torch.uint8, 0, GgmlBlocks(int(ggml_type), (rows, cols))
        )
        for name, (rows, cols) in _weights(shapes).items()
    )


def fp8_scale_block(scales: str, shape: tuple[int, int], stacked: int = 1) -> tuple[int, int]:
    """The scale block of `scales` (one of FP8_SCALES) for an `(out, in)` weight of `stacked`
    matrices (gate and up keep a scale each)."""
    return (128, 128) if scales == "block-128" else (shape[0] // stacked, shape[1])


def fp8_experts_layout(scales: str, shapes: Shapes) -> ExpertLayout:
    return fp8_layout(
        (name, shape, fp8_scale_block(scales, shape, 2 if name == "gate_up_proj" else 1))
        for name, shape in _weights(shapes).items()
    )


def int4_experts_layout(fmt: str, act_order: bool, shapes: Shapes) -> ExpertLayout:
    """Groups of `shapes.group_size` inputs; float16 scales (compressed-tensors: bfloat16, as its
    releases keep them); act-order's g_idx a row per stacked matrix."""
    scales = torch.bfloat16 if fmt in int4.ROW_MAJOR else torch.float16
    stacked = {"gate_up_proj": 2, "down_proj": 1}
    fields = [
        (name, shape, fmt, shape[1] // shapes.group_size, stacked[name] * act_order)
        for name, shape in _weights(shapes).items()
    ]
    return int4_layout(fields, scales)


def field_bytes(layout: ExpertLayout, name: str) -> int:
    """Bytes of field `name` of an expert with its companions (scales, zeros, g_idx)."""
    fields = {f.name: f for f in layout.fields}
    return sum(fields[n].nbytes for n in (name, *fields[name].format.companions(name)) if n in fields)


def _generator(device: torch.device | str) -> torch.Generator:
    return torch.Generator(device).manual_seed(0)


def expert_pool(
    layout: ExpertLayout, shapes: Shapes, device: torch.device | str, rng: np.random.Generator
) -> tuple[torch.Tensor, list[int]]:
    """uint8 `[slots, layout.nbytes]` on `device` and the slots of `shapes.experts` experts filled
    with valid random values, shuffled; the other rows random bytes, `shapes.timing_bytes` of them
    past the experts (what the timed launches read)."""
    slots = shapes.experts + -(-shapes.timing_bytes // layout.nbytes)
    pool = torch.randint(
        0, 256, (slots, layout.nbytes), dtype=torch.uint8, device=device, generator=_generator(device)
    )
    chosen = rng.permutation(slots)[: shapes.experts].tolist()
    for slot in chosen:
        row = torch.zeros(layout.nbytes, dtype=torch.uint8)
        for weight in layout.views(row).values():
            fill(weight, rng)
        pool[slot] = row.to(device)
    return pool, chosen


def normal(rng: np.random.Generator, *shape: int) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def routed_case(
    layout: ExpertLayout,
    x_dtype: str,
    shapes: Shapes,
    device: torch.device | str,
    rng: np.random.Generator,
    clamped: tuple[float, float] | None = None,
) -> Case:
    """One token's `moe_gate_up` and `moe_down` of the top-k of the pool's experts, in `x_dtype`;
    with `clamped` (gpt-oss's alpha and limit), `moe_gate_up_clamped` and `moe_down_biased`."""
    pool, slots = expert_pool(layout, shapes, device, rng)
    gate_up, down = projection(layout, "gate_up_proj"), projection(layout, "down_proj")
    if isinstance(gate_up, str) or isinstance(down, str):
        raise ValueError(f"no fused kernel reads the layout: {gate_up if isinstance(gate_up, str) else down}")
    dtype, top_k, inter, row = DTYPES[x_dtype], shapes.top_k, gate_up.rows // 2, pool.shape[1]
    table = torch.tensor(slots, device=device)  # int64, as ExpertCache.slot_table makes it
    ids = torch.tensor(rng.choice(len(slots), top_k, replace=False), device=device)
    x = normal(rng, gate_up.columns).to(device, dtype)
    weights = torch.from_numpy(rng.random(top_k).astype(np.float32)).to(device, dtype)
    act = torch.empty(top_k, inter, device=device)
    out = torch.empty(down.rows, dtype=dtype, device=device)
    names, up_ints, down_ints, gate = ROUTED, gate_up.ints, down.ints, ()
    if clamped is not None:
        fields = {f.name: f for f in layout.fields}
        names, gate = CLAMPED, clamped
        up_ints, down_ints = (*up_ints, fields[BIASES[0]].offset), (*down_ints, fields[BIASES[1]].offset)

    def gate_up_args(table: torch.Tensor, ids: torch.Tensor) -> tuple:
        return (x, pool, table, ids, act, row, *up_ints, inter, gate_up.columns, *gate)

    def down_args(table: torch.Tensor, ids: torch.Tensor) -> tuple:
        return (act, pool, table, ids, weights, out, row, *down_ints, down.rows, down.columns, top_k)

    every = torch.arange(len(pool), device=device)  # the timed launches' table: row r is expert r
    turns = [(every, every[r : r + top_k].clone()) for r in range(0, len(pool) - top_k + 1, top_k)]
    launches = tuple(
        Launch(
            p.cubin(name, x_dtype),
            grid,
            args(table, ids),
            (judged,),
            top_k * field_bytes(layout, field),
            tuple(args(*turn) for turn in turns),
        )
        for name, p, grid, args, judged, field in (
            (names[0], gate_up, (-(-inter // gate_up.block_n), top_k), gate_up_args, "act", "gate_up_proj"),
            (names[1], down, (-(-down.rows // down.block_n),), down_args, "out", "down_proj"),
        )
    )

    def compare() -> dict:
        experts = [layout.views(pool[slots[expert]]) for expert in ids.tolist()]
        acts = [_reference_act(x, views, clamped) for views in experts]
        want = torch.zeros(down.rows, dtype=torch.float64, device=x.device)
        for k, views in enumerate(experts):
            y = F.linear(act[k].double(), dequantized(views["down_proj"]).double())
            want += weights[k].double() * (y if clamped is None else y + views[BIASES[1]].double())
        return {"act": (act, torch.stack(acts)), "out": (out, want)}

    return Case(launches, compare)


def _reference_act(x: torch.Tensor, views: dict, clamped: tuple[float, float] | None) -> torch.Tensor:
    """One expert's activation in float64: silu(gate) · up (gate rows first), or gpt-oss's gate
    (`clamped`: its alpha and limit) on its biased, interleaved gate and up rows."""
    gate_up = F.linear(x.double(), dequantized(views["gate_up_proj"]).double())
    if clamped is None:
        gate, up = gate_up.chunk(2)
        return F.silu(gate) * up
    alpha, limit = clamped
    gate_up = gate_up + views[BIASES[0]].double()
    gate, up = gate_up[::2].clamp(max=limit), gate_up[1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def clamped_case(x_dtype: str, shapes: Shapes, device, rng: np.random.Generator) -> Case:
    """gpt-oss's routed pair over MXFP4 experts with their biases (in `x_dtype`, as the store keeps
    them in the compute dtype) and its gate's alpha and limit."""
    biases = ExpertLayout.from_shapes(
        {BIASES[0]: (2 * shapes.inter,), BIASES[1]: (shapes.hidden,)}, DTYPES[x_dtype]
    )
    layout = ExpertLayout.placed([*kquant_layout(QT.MXFP4, shapes).fields, *biases.fields])
    return routed_case(layout, x_dtype, shapes, device, rng, clamped=GPT_OSS_GATE)


def _matrices(first: torch.Tensor, timing_bytes: int, device: torch.device | str) -> list[torch.Tensor]:
    """`first` on `device`, then random matrices of its size, `timing_bytes` of them: what the
    timed launches read in turn."""
    copies = -(-timing_bytes // first.numel())
    spare = torch.randint(
        0, 256, (copies, *first.shape), dtype=torch.uint8, device=device, generator=_generator(device)
    )
    return [first.to(device), *spare.unbind(0)]


def _gemv_case(
    kernel: str,
    block_n: int,
    matrices: list[torch.Tensor],
    x: torch.Tensor,
    reference,
    scale_inv: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> Case:
    """`kernel` on each `[rows, …]` matrix in turn (with FP8's `scale_inv` and `block`): `out = W @ x`
    float32, judged on the first against `reference(matrix)`'s float32 weight."""
    rows = matrices[0].shape[0]
    out = torch.empty(rows, device=x.device)

    def args(matrix: torch.Tensor) -> tuple:
        if scale_inv is None:  # kquant_moe's: x, blocks, out, out_features, in_features
            return (x, matrix, out, rows, x.numel())
        return (x, matrix, scale_inv, out, rows, x.numel(), *block)

    read = matrices[0].numel() + (0 if scale_inv is None else 4 * scale_inv.numel())
    grid = (-(-rows // block_n),)
    launch = Launch(kernel, grid, args(matrices[0]), ("gemv",), read, tuple(args(m) for m in matrices))
    return Case((launch,), lambda: {"gemv": (out, F.linear(x.double(), reference(matrices[0]).double()))})


def kquant_case(ggml_type: QT, x_dtype: str, shapes: Shapes, device, rng: np.random.Generator) -> Case:
    """`ggml_type`'s three kernels: the routed pair, and the GEMV of a `(gemv_rows, hidden)` matrix."""
    rows, columns = shapes.gemv_rows, shapes.hidden
    matrices = _matrices(random_blocks(ggml_type, rows, columns, rng), shapes.timing_bytes, device)
    x = normal(rng, columns).to(device, DTYPES[x_dtype])
    gemv = _gemv_case(
        kquant_name("quantized_gemv", ggml_type, x_dtype),
        KQUANT_BLOCK_N,
        matrices,
        x,
        lambda m: blocks.dequantize(m, ggml_type, (rows, columns), torch.float32),
    )
    return merged(routed_case(kquant_layout(ggml_type, shapes), x_dtype, shapes, device, rng), gemv)


def fp8_case(scales: str, x_dtype: str, shapes: Shapes, device, rng: np.random.Generator) -> Case:
    """FP8's three kernels with `scales` (one of FP8_SCALES): the routed pair and the GEMV."""
    rows, columns = shapes.gemv_rows, shapes.hidden
    block = fp8_scale_block(scales, (rows, columns))
    matrices = _matrices(random_codes(rng, (rows, columns)), shapes.timing_bytes, device)
    scale_inv = random_scales(rng, scale_shape((rows, columns), block)).to(device)
    x = normal(rng, columns).to(device, DTYPES[x_dtype])
    gemv = _gemv_case(
        fp8_name("quantized_gemv", x_dtype),
        FP8_BLOCK_N,
        matrices,
        x,
        lambda m: fp8.dequantize(Fp8Weight(m.view(FP8_DTYPE), scale_inv, block)),
        scale_inv,
        block,
    )
    layout = fp8_experts_layout(scales, shapes)
    return merged(routed_case(layout, x_dtype, shapes, device, rng), gemv)


def int4_case(fmt: str, act_order: bool, x_dtype: str, shapes: Shapes, device, rng) -> Case:
    """One int4 variant's routed pair."""
    return routed_case(int4_experts_layout(fmt, act_order, shapes), x_dtype, shapes, device, rng)
