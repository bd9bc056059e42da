"""GGUF/ggml quantized tensors dequantized on the device, driven by one table of per-type traits.

Contract: a GGUF tensor of logical shape `[..., n]` is stored as rows of `n // block_size`
blocks of `block_bytes` bytes each (ggml's `ne[0]`, the contiguous input dim, is the
row). `dequantize(data, ggml_type, shape, dtype)` takes those bytes as a uint8 tensor
`[..., row_bytes]` on any device and returns `shape` in `dtype` on the same device,
computed in float32 with plain vectorised torch ops (no loop over blocks) and cast at the
end; `linear(x, data, ...)` is `F.linear(x, dequantize(...))`, so W is `[out, in]`.
An expert sliced from a 3-D tensor `[E, rows, row_bytes]` is its own byte range: its
bytes dequantize alone. The float32 result equals gguf's numpy `quants.dequantize` bit
for bit (the same float32 operations in the same order).

`TYPES` is the table, one `GgmlType` per type, like ggml's `type_traits`: block size and
bytes (from `gguf.GGML_QUANT_SIZES`), the block's byte layout as named fields in order,
and `decode`, which turns those fields into weights. Field kinds: `u8`/`i8` raw codes,
`f16`/`bf16`/`f32` scales or values (handed to `decode` already as float32):

    F32, F16, BF16  value                                   1 weight a block
    Q8_0            d:f16 | qs:i8[32]                        d * q
    Q4_0 / Q5_0     d:f16 | (qh:u8[4]) | qs:u8[16]           d * (q - 8) / d * (q - 16)
    Q4_1 / Q5_1     d:f16 | m:f16 | (qh:u8[4]) | qs:u8[16]   d * q + m
    Q2_K            scales:u8[16] | qs:u8[64] | d | dmin     16 sub-blocks of 16
    Q3_K            hmask[32] | qs[64] | scales[12] | d      6-bit signed sub-block scales
    Q4_K / Q5_K     d | dmin | scales[12] | (qh[32]) | qs[128]   8 sub-blocks of 32
    Q6_K            ql[128] | qh[64] | scales:i8[16] | d     16 sub-blocks of 16
    IQ4_NL          d:f16 | qs[16]                           d * kvalues[q]
    IQ4_XS          d | scales_h[2] | scales_l[4] | qs[128]  8 sub-blocks of 32
    MXFP4           e:u8 (e8m0) | qs[16]                     2^(e-128) * e2m1 doubled

Low nibbles come before high nibbles within each group of packed bytes, and bit planes
(`qh`, `hmask`) run across the group, as in ggml-quants.c. Any other type raises
`UnsupportedQuantizationError`.

F32 rows may come back as a view of `data` (no copy, as `Tensor.to` does); every other type
makes a fresh tensor.

The float codes are scaled in place: a fresh float32 temporary per step would page-fault on
every call. `linear` on Q4_K and Q6_K (llama.cpp's Q4_K_M) goes through
`engine.formats.gguf.kquant_matmul`, which builds the same weight bit for bit in a reused buffer, with
fewer passes, `CHUNK_BYTES` of rows at a time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.errors import UnsupportedQuantizationError
from engine.formats.gguf.kquant_matmul import k_scale_min, q4_k_linear, q6_k_linear

Q = GGMLQuantizationType
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # MXFP4 codes, ×2
# `linear` builds a type's float32 weight this many bytes of rows at a time, so the part being
# built stays in cache.
CHUNK_BYTES = 4 << 20


class Field(NamedTuple):
    """One field of a block: its name, its size in bytes, and how its bytes are read."""

    name: str
    nbytes: int
    kind: str = "u8"  # u8 | i8 | f16 | bf16 | f32


@dataclass(frozen=True)
class GgmlType:
    """The traits of one ggml type: how big a block is, where its fields lie, how it decodes."""

    name: str
    ggml_type: GGMLQuantizationType
    block_size: int  # weights per block
    block_bytes: int
    fields: tuple[Field, ...]  # the block's bytes, in order
    decode: Callable[..., torch.Tensor]  # fields by name -> float32 [n_blocks, block_size]
    # (x [T, in] float32, fields, out_features) -> x @ W.T without dequantize's matrix
    linear: Callable[..., torch.Tensor] | None = None

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        """uint8 [n_blocks, block_bytes] -> float32 [n_blocks, block_size]."""
        return self.decode(**split_fields(blocks, self.fields))


def _read_as(field_bytes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A field's bytes `[n_blocks, nbytes]` read as `dtype`: a view where the blocks' strides
    allow it (a kernel less on a GPU), else a contiguous copy's."""
    try:
        return field_bytes.view(dtype)
    except RuntimeError:
        return field_bytes.contiguous().view(dtype)


_READ_FIELD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "u8": lambda b: b,
    "i8": lambda b: b.view(torch.int8),
    "f16": lambda b: _read_as(b, torch.float16).float(),
    "bf16": lambda b: _read_as(b, torch.bfloat16).float(),
    "f32": lambda b: _read_as(b, torch.float32),
}


def split_fields(blocks: torch.Tensor, fields: tuple[Field, ...]) -> dict[str, torch.Tensor]:
    """Each field's columns of `blocks [n_blocks, block_bytes]`, read as its kind says."""
    out, start = {}, 0
    for field in fields:
        out[field.name] = _READ_FIELD[field.kind](blocks[:, start : start + field.nbytes])
        start += field.nbytes
    return out


def unpack_bits(packed: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """uint8 [n, k] -> codes [n, k * 8 // bits]: each group of `group` bytes gives its
    lowest `bits` bits first (one code per byte), then the next `bits`, and so on."""
    groups = packed.reshape(packed.shape[0], -1, group)
    # one scalar shift per bit plane (≤ 8): much faster than a broadcast shift on the CPU
    planes = [(groups >> shift) & ((1 << bits) - 1) for shift in range(0, 8, bits)]
    return torch.stack(planes, dim=-2).reshape(packed.shape[0], -1)  # [n, groups, planes, group]


@functools.cache
def _value_table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)  # made once per device


def _lookup(values: tuple[int, ...], codes: torch.Tensor) -> torch.Tensor:
    return torch.take(_value_table(values, codes.device), codes.long())  # a fresh tensor


def _float(value: torch.Tensor) -> torch.Tensor:
    return value


# The decoders make one float32 tensor of codes and scale it in place: a fresh temporary of
# the whole matrix costs as much as the arithmetic (page faults), and in place is bit-exact.
def _q8_0(d: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return qs.float().mul_(d)


def _q4_0(d: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return unpack_bits(qs, 4, 16).float().sub_(8).mul_(d)


def _q4_1(d: torch.Tensor, m: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return unpack_bits(qs, 4, 16).float().mul_(d).add_(m)


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Codes 0..31 of a 32-weight block: nibbles from `qs`, the fifth bit from the 32 bits of `qh`."""
    return unpack_bits(qs, 4, 16).bitwise_or_(unpack_bits(qh, 1, 1) << 4).float()


def _q5_0(d: torch.Tensor, qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _five_bit(qh, qs).sub_(16).mul_(d)


def _q5_1(d: torch.Tensor, m: torch.Tensor, qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _five_bit(qh, qs).mul_(d).add_(m)


def _q2_k(scales: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    scale = (d * (scales & 0xF).float()).view(n, 16, 1)
    low = (dmin * (scales >> 4).float()).view(n, 16, 1)
    return unpack_bits(qs, 2, 32).float().view(n, 16, 16).mul_(scale).sub_(low).view(n, -1)


def _q3_k(hmask: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    # 16 six-bit scales: low nibbles from bytes 0..7, two high bits from bytes 8..11
    six_bit = unpack_bits(scales[:, :8], 4, 8) | (unpack_bits(scales[:, 8:], 2, 4) << 4)
    scale = (d * (six_bit.float() - 32)).view(n, 16, 1)
    minus_four = (unpack_bits(hmask, 1, 32) ^ 1) << 2  # 4 is subtracted where the mask bit is 0
    q = unpack_bits(qs, 2, 32).float().sub_(minus_four)
    return q.view(n, 16, 16).mul_(scale).view(n, -1)


def _k_sub_blocks(d, dmin, scales, codes: torch.Tensor) -> torch.Tensor:
    n = codes.shape[0]
    sc, mn = k_scale_min(scales)
    scale, low = (d * sc).view(n, 8, 1), (dmin * mn).view(n, 8, 1)
    return codes.float().view(n, 8, 32).mul_(scale).sub_(low).view(n, -1)


def _q4_k(d, dmin, scales, qs: torch.Tensor) -> torch.Tensor:
    return _k_sub_blocks(d, dmin, scales, unpack_bits(qs, 4, 32))


def _q5_k(d, dmin, scales, qh, qs: torch.Tensor) -> torch.Tensor:
    codes = unpack_bits(qs, 4, 32).bitwise_or_(unpack_bits(qh, 1, 32) << 4)
    return _k_sub_blocks(d, dmin, scales, codes)


def _q6_k(ql: torch.Tensor, qh: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n = ql.shape[0]
    codes = unpack_bits(ql, 4, 64).bitwise_or_(unpack_bits(qh, 2, 32) << 4)
    scale = (d * scales.float()).view(n, 16, 1)
    return codes.float().sub_(32).view(n, 16, 16).mul_(scale).view(n, -1)


def _iq4_nl(d: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _lookup(IQ4_NL_VALUES, unpack_bits(qs, 4, 16)).mul_(d)


def _iq4_xs(d, scales_h, scales_l, qs: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    six_bit = unpack_bits(scales_l, 4, 1) | (unpack_bits(scales_h, 2, 1) << 4)  # [n, 8]
    scale = (d * (six_bit.float() - 32)).view(n, 8, 1)
    return _lookup(IQ4_NL_VALUES, unpack_bits(qs, 4, 16)).view(n, 8, 32).mul_(scale).view(n, -1)


def _mxfp4(e: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    # e8m0 scale, halved because the e2m1 table is doubled: 2^(e - 128) as float32 bits
    e = e.int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return _lookup(E2M1_DOUBLED, unpack_bits(qs, 4, 16)).mul_(bits.view(torch.float32))


def _entry(
    ggml_type: GGMLQuantizationType,
    fields: tuple[Field, ...],
    decode: Callable,
    linear: Callable | None = None,
) -> GgmlType:
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    assert sum(f.nbytes for f in fields) == block_bytes, f"{ggml_type.name}: layout ≠ block bytes"
    return GgmlType(ggml_type.name, ggml_type, block_size, block_bytes, fields, decode, linear)


D_F16, QS16, QH4 = Field("d", 2, "f16"), Field("qs", 16), Field("qh", 4)
K_HEAD = (Field("d", 2, "f16"), Field("dmin", 2, "f16"), Field("scales", 12))
TYPES: dict[GGMLQuantizationType, GgmlType] = {
    t.ggml_type: t
    for t in (
        _entry(Q.F32, (Field("value", 4, "f32"),), _float),
        _entry(Q.F16, (Field("value", 2, "f16"),), _float),
        _entry(Q.BF16, (Field("value", 2, "bf16"),), _float),
        _entry(Q.Q8_0, (D_F16, Field("qs", 32, "i8")), _q8_0),
        _entry(Q.Q4_0, (D_F16, QS16), _q4_0),
        _entry(Q.Q4_1, (D_F16, Field("m", 2, "f16"), QS16), _q4_1),
        _entry(Q.Q5_0, (D_F16, QH4, QS16), _q5_0),
        _entry(Q.Q5_1, (D_F16, Field("m", 2, "f16"), QH4, QS16), _q5_1),
        _entry(
            Q.Q2_K,
            (Field("scales", 16), Field("qs", 64), Field("d", 2, "f16"), Field("dmin", 2, "f16")),
            _q2_k,
        ),
        _entry(Q.Q3_K, (Field("hmask", 32), Field("qs", 64), Field("scales", 12), D_F16), _q3_k),
        _entry(Q.Q4_K, (*K_HEAD, Field("qs", 128)), _q4_k, q4_k_linear),
        _entry(Q.Q5_K, (*K_HEAD, Field("qh", 32), Field("qs", 128)), _q5_k),
        _entry(
            Q.Q6_K, (Field("ql", 128), Field("qh", 64), Field("scales", 16, "i8"), D_F16), _q6_k, q6_k_linear
        ),
        _entry(Q.IQ4_NL, (D_F16, QS16), _iq4_nl),
        _entry(Q.IQ4_XS, (D_F16, Field("scales_h", 2), Field("scales_l", 4), Field("qs", 128)), _iq4_xs),
        _entry(Q.MXFP4, (Field("e", 1), QS16), _mxfp4),
    )
}


def ggml_type_traits(ggml_type: GGMLQuantizationType | int) -> GgmlType:
    """The table's entry for `ggml_type`; `UnsupportedQuantizationError` for any other type."""
    try:
        return TYPES[GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        name = getattr(ggml_type, "name", None) or f"type id {ggml_type}"
        supported = ", ".join(t.name for t in TYPES.values())
        raise UnsupportedQuantizationError(
            f"GGUF tensors of type {name} are not supported; supported types: {supported}."
        ) from None


def row_bytes(ggml_type: GGMLQuantizationType | int, n_weights: int) -> int:
    """Bytes of a row of `n_weights` weights; `n_weights` must fill whole blocks."""
    traits = ggml_type_traits(ggml_type)
    if n_weights % traits.block_size:
        raise ValueError(
            f"a {traits.name} row holds whole blocks of {traits.block_size} weights; "
            f"{n_weights} weights is not a multiple of {traits.block_size}"
        )
    return n_weights // traits.block_size * traits.block_bytes


def dequantize(
    data: torch.Tensor, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """uint8 `[..., row_bytes]` -> `shape` in `dtype` on data's device (float32 math, cast last)."""
    traits = ggml_type_traits(ggml_type)
    expected = row_bytes(traits.ggml_type, shape[-1]) * math.prod(shape[:-1])
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise ValueError(
            f"{traits.name} weights of shape {tuple(shape)} take {expected} bytes (uint8); "
            f"got {data.numel()} elements of {data.dtype}"
        )
    blocks = data.reshape(-1, traits.block_bytes)  # [n_blocks, block_bytes]
    return traits.dequantize(blocks).reshape(shape).to(dtype)


def linear(
    x: torch.Tensor,
    data: torch.Tensor,
    ggml_type: GGMLQuantizationType | int,
    out_features: int,
    in_features: int,
) -> torch.Tensor:
    """`x @ W.T` for the quantized `W [out_features, in_features]` (rows along `in_features`).

    Float32 x through a type's own `linear` (`engine.formats.gguf.kquant_matmul`: no float32 matrix
    of the weight in the file's layout), else `F.linear` on the dequantized weight. Half-precision
    x on the CPU goes through the float32 `linear` too, cast back once: bfloat16 matmuls and
    elementwise ops are slow there, and the result is the exact product rounded once."""
    traits = ggml_type_traits(ggml_type)
    if traits.linear is not None and x.dtype != torch.float32 and x.device.type == "cpu":
        return linear(x.float(), data, ggml_type, out_features, in_features).to(x.dtype)
    if traits.linear is None or x.dtype != torch.float32:
        return F.linear(x, dequantize(data, ggml_type, (out_features, in_features), x.dtype))
    if data.dtype != torch.uint8 or data.numel() != row_bytes(traits.ggml_type, in_features) * out_features:
        raise ValueError(f"{traits.name} bytes do not hold a {out_features}×{in_features} weight")
    rows, tokens = data.reshape(out_features, -1), x.reshape(-1, in_features)
    step = max(1, CHUNK_BYTES // (4 * in_features))
    parts = [
        traits.linear(tokens, split_fields(chunk.reshape(-1, traits.block_bytes), traits.fields), len(chunk))
        for chunk in rows.split(step)
    ]
    y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    return y.view(*x.shape[:-1], out_features)
