"""Group-wise int8 / int4 quantization of expert weight matrices, on plain torch ops.

Contract: a weight matrix `W [..., C]` is stored as integer codes plus one scale and
one offset per group of `g` consecutive elements of its last (contiguous) dim:

    W[r, j] ≈ codes[r, j] * scales[r, j // g] + offsets[r, j // g]

(asymmetric: `offset` is the value of code 0). Its fields replace the field `name`:

    name.qweight   int8  [..., C]       int8: codes -128..127
                   uint8 [..., C // 2]  int4: codes 0..15; byte j of a row holds element j in
                                        its low nibble and element j + C/2 in its high one
    name.scales    compute dtype [..., C // g]
    name.offsets   compute dtype [..., C // g]

The codes' dtype tells the bit width, so `linear` needs nothing but the views. The
bytes are plain row-major arrays, the same on CPU and CUDA. `g` is the largest
divisor of C not above `group_size` (64 divides every real MoE width); a row of odd
length cannot be split into nibble pairs, so under int4 it is stored as int8.
Groups run along the last dim: the input dim of `[out, in]` weights (`F.linear`),
the output dim of gpt-oss's transposed `[in, out]` weights. Every field with two or
more dims is a weight matrix and is quantized; 1-D fields (biases) stay as they are.

Asymmetric, because its error (of the weights and of `x @ W.T`) is lower than symmetric
quantization's at both widths. Every weight is rebuilt within scale/2 of its value.

`linear` dequantizes into a fresh tensor, then runs the native matmul, so it equals
`dequantize` followed by `F.linear` exactly. Rejected: applying the scales to per-group
partial sums (`bmm`) or the offsets through a small matmul (faster only for large float32
weights at one row); interleaved nibbles (slower to unpack than two halves);
`torch._weight_int8pack_mm` (per-channel scales only) and `torch._weight_int4pack_mm_for_cpu`
(a CPU-specific packed layout), faster than native in bfloat16 but slower in float32, and
reading neither group-wise nor device-agnostic bytes. Half-precision elementwise ops are slow
on CPU, so there a weight is dequantized and multiplied in float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.config import EXPERT_DTYPES

QUANT_DTYPES = EXPERT_DTYPES  # ("native", "int8", "int4")

Field = tuple[str, tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class QuantSpec:
    """Bits per weight and the number of weights sharing one scale and offset."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"Quantization supports 4 or 8 bits, not {self.bits}.")
        if self.group_size < 1:
            raise ValueError(f"The quantization group size must be positive, not {self.group_size}.")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @classmethod
    def from_dtype(cls, expert_dtype: str, group_size: int = 64) -> QuantSpec | None:
        """The spec an `OffloadConfig.expert_dtype` names; None for native experts."""
        if expert_dtype not in QUANT_DTYPES:
            raise ValueError(
                f"Unknown expert dtype {expert_dtype!r}; choose one of {', '.join(QUANT_DTYPES)}."
            )
        if expert_dtype == "native":
            return None
        return cls(bits=int(expert_dtype.removeprefix("int")), group_size=group_size)


def is_weight(shape: tuple[int, ...]) -> bool:
    """Whether a field of this shape is a weight matrix (quantized) rather than a bias."""
    return len(shape) >= 2


def group_size_for(columns: int, spec: QuantSpec) -> int:
    """The largest divisor of the row length not above the spec's group size."""
    return next(g for g in range(min(spec.group_size, columns), 0, -1) if columns % g == 0)


def _bits_for(columns: int, spec: QuantSpec) -> int:
    return 4 if spec.bits == 4 and columns % 2 == 0 else 8


def quantized_fields(
    name: str, shape: tuple[int, ...], spec: QuantSpec, compute_dtype: torch.dtype
) -> list[Field]:
    """The packed fields that replace the weight field `name` of `shape`."""
    *rows, columns = shape
    bits = _bits_for(columns, spec)
    groups = columns // group_size_for(columns, spec)
    codes = ((*rows, columns), torch.int8) if bits == 8 else ((*rows, columns // 2), torch.uint8)
    return [
        (f"{name}.qweight", *codes),
        (f"{name}.scales", (*rows, groups), compute_dtype),
        (f"{name}.offsets", (*rows, groups), compute_dtype),
    ]


def _round_up(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`value` in `dtype`, never below it: a stored scale that covers its group's range."""
    stored = value.to(dtype)
    return torch.where(
        stored.float() < value, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored
    )


@torch.no_grad()
def quantize_into(
    weight: torch.Tensor, views: Mapping[str, torch.Tensor], name: str, spec: QuantSpec
) -> None:
    """Write `weight`'s codes, scales and offsets into the views `quantized_fields` describes."""
    codes_view, scales_view = views[f"{name}.qweight"], views[f"{name}.scales"]
    columns = weight.shape[-1]
    bits, group = _bits_for(columns, spec), group_size_for(columns, spec)
    groups = weight.detach().float().reshape(-1, columns // group, group)  # [R, G, g]
    low, high = torch.aminmax(groups, dim=-1)  # [R, G]
    scale = _round_up((high - low) / (2**bits - 1), scales_view.dtype)
    # Offsets are the value of code 0: int8 codes are signed, so theirs sits mid-range.
    offset = (low + 128 * scale.float() if bits == 8 else low).to(scales_view.dtype)
    # Codes are computed against the stored (rounded) scale and offset, so rounding them costs nothing.
    divisor = torch.where(scale > 0, scale.float(), 1.0)
    codes = (groups - offset.float()[..., None]).div_(divisor[..., None]).round_()  # one temporary
    if bits == 8:
        codes_view.copy_(codes.clamp_(-128, 127).view(codes_view.shape))
    else:  # the row's first half in the low nibbles, its second half in the high ones
        nibbles = codes.clamp_(0, 15).to(torch.uint8).view(-1, columns)
        low, high = nibbles[:, : columns // 2], nibbles[:, columns // 2 :]
        codes_view.copy_((low | (high << 4)).view(codes_view.shape))
    scales_view.copy_(scale.view(scales_view.shape))
    views[f"{name}.offsets"].copy_(offset.view(scales_view.shape))


def _dequantized(views: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """The weight `name` rebuilt from its quantized fields, `[..., C]` in `dtype`."""
    codes, scales = views[f"{name}.qweight"], views[f"{name}.scales"]
    if codes.dtype == torch.uint8:  # int4: element j in the low nibble of byte j, j + C/2 in its high one
        half = codes.shape[-1]
        weight = torch.empty((*codes.shape[:-1], 2 * half), dtype=dtype, device=codes.device)
        weight[..., :half] = codes & 0xF  # two contiguous halves: faster to unpack than interleaved nibbles
        weight[..., half:] = codes >> 4
    else:
        weight = codes.to(dtype)
    weight = weight.view(*scales.shape, -1)  # [..., G, g], a fresh tensor: scaled in place
    weight.mul_(scales.unsqueeze(-1)).add_(views[f"{name}.offsets"].unsqueeze(-1))
    return weight.flatten(-2)


def _work_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Half-precision elementwise ops are slow on CPU: there, dequantize in float32."""
    return torch.float32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else dtype


def dequantize(
    views: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...], spec: QuantSpec, dtype: torch.dtype
) -> torch.Tensor:
    """The weight `name` of `shape` in `dtype`, from its quantized fields (or its native view)."""
    if name in views:
        return views[name].to(dtype)
    expected = quantized_fields(name, shape, spec, views[f"{name}.scales"].dtype)
    found = [(n, tuple(views[n].shape), views[n].dtype) for n, _, _ in expected]
    if found != expected:
        raise ValueError(
            f"The fields of {name} are {found}, not the {spec.name} form of {shape}: {expected}."
        )
    codes = views[f"{name}.qweight"]
    weight = _dequantized(views, name, _work_dtype(dtype, codes.device))
    return weight.view(shape).to(dtype)


def linear(x: torch.Tensor, views: Mapping[str, torch.Tensor], name: str, transposed: bool) -> torch.Tensor:
    """`x @ W.T` (`x @ W` when `transposed`) for the expert weight `name`, native or quantized.

    Native views compute exactly as transformers' experts do. A checkpoint format's own weight
    (`GgmlWeight` of a GGUF file, `Fp8Weight`, GPTQ/AWQ `Int4Weight`) computes itself: it holds
    `(out, in)` rows whatever the family's own orientation."""
    weight = views.get(name)
    if hasattr(weight, "linear"):  # a format's weight object, not a tensor
        return weight.linear(x)
    if weight is None:
        work = _work_dtype(x.dtype, x.device)
        weight = _dequantized(views, name, work)
        if work != x.dtype:
            return linear(x.to(work), {name: weight}, name, transposed).to(x.dtype)
    return x @ weight if transposed else F.linear(x, weight)
