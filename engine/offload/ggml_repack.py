"""Q4_K experts repacked once, at load, for torch's CPU int4 kernel: the bfloat16 path.

Contract: `repack_q4_k(blocks, out, in)` turns one Q4_K weight `[out, in]` (the file's blocks,
uint8 `[out, row bytes]`) into `packed_nbytes(out, in)` bytes: first the codes as
`torch.ops.aten._convert_weight_to_int4pack_for_cpu` lays them out (uint8 `[out, in / 2]`, a
layout of this CPU's kernel), then bfloat16 scales and zeros `[in / 32, out, 2]`.
`int4pack_linear(x, packed, out, in)` is `x @ W.T` from those bytes through
`torch.ops.aten._weight_int4pack_mm_for_cpu`, in bfloat16 (other dtypes are cast to it and back).

Exact fit of the values, not of their precision: a Q4_K weight is `d·sc·q − dmin·m` for its
32-weight sub-block, and the kernel computes `(q − 8)·scale + zero` per group of 32, so
`scale = d·sc` and `zero = 8·scale − dmin·m`. The kernel takes its scales in the activations'
dtype: in bfloat16 each sub-block's scale and zero are rounded to 8 bits of mantissa (a weight
moves by at most ~1/64 of its sub-block's step, about what storing W in bfloat16 does to it),
and the kernel accumulates in float32 and rounds its output to bfloat16. So the path is used
only where the model computes in bfloat16 on the CPU (`gguf_store`, `repack=True`); float32
runs keep `ggml_linear`'s bit-exact rebuild. Measured on a 768-wide tiny GGUF model against
transformers in bfloat16 on the dequantized weights: see tests/engine/offload/test_ggml_int4pack.py.

Why (this 2-core AVX2 CPU, torch 2.13, one thread, under other jobs' load, median ms, 1536×2048
Q4_K; then 2048×768): one row 0.48–0.70 (0.31) against 6.6 (2.2) for the float32 rebuild and
0.61 (0.16) for a native float32 matrix; 16 rows 5.7 (4.3) against 10.9 (6.9). The kernel has
no vectorised float32 path on x86 (8.6 ms a row: a scalar loop), hence bfloat16 only. Computing
the scales and zeros from the Q4_K header at each call costs 1.3 ms (3× the kernel), so they are
stored: 160 bytes per 256 weights against Q4_K's 144 (the store is 1.11× the file's experts).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from engine.offload.ggml_linear import k_scale_min

INT4PACK = "int4pack"  # the packing's name, as an `ExpertField.packing`
GROUP = 32  # weights per scale and zero: one Q4_K sub-block
_Q4_K_BLOCK, _Q4_K_BYTES = 256, 144
_N_BLOCK = 16  # the kernel takes its output rows in blocks of 16, 32, 48 or 64


def can_repack(ggml_type: int, out_features: int, in_features: int) -> bool:
    """Whether a weight of this type and shape has an int4pack form."""
    return (
        ggml_type == GGMLQuantizationType.Q4_K
        and out_features % _N_BLOCK == 0
        and in_features % _Q4_K_BLOCK == 0
    )


def packed_nbytes(out_features: int, in_features: int) -> int:
    """Bytes of a repacked `[out, in]` weight: 4-bit codes, then a bfloat16 scale and zero per 32."""
    return out_features * in_features // 2 + (in_features // GROUP) * out_features * 2 * 2


def repack_q4_k(blocks: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Q4_K blocks (uint8, `out * in / 256 * 144` bytes) -> the int4pack bytes of the same weight."""
    if not can_repack(GGMLQuantizationType.Q4_K, out_features, in_features):
        raise ValueError(f"A {out_features}×{in_features} Q4_K weight has no int4pack form.")
    expected = out_features * in_features // _Q4_K_BLOCK * _Q4_K_BYTES
    if blocks.dtype != torch.uint8 or blocks.numel() != expected:
        raise ValueError(f"Q4_K {out_features}×{in_features} takes {expected} bytes; got {blocks.numel()}.")
    blocks = blocks.reshape(-1, _Q4_K_BYTES)  # [n, 144]: d f16 | dmin f16 | scales[12] | qs[128]
    n = blocks.shape[0]
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)  # sub-block 2g+h: nibble h of bytes 32g..32g+31
    codes = torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(out_features, in_features)
    packed_codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    sc, mn = k_scale_min(blocks[:, 4:16].contiguous())  # [n, 8] each
    scale = d * sc  # as ggml: float32 d·sc, then dmin·m
    zero = 8 * scale - dmin * mn
    # [in/32, out, 2]: the kernel reads one group's scales and zeros for a block of rows at once
    scale_zero = torch.stack([scale, zero], dim=-1).view(out_features, -1, 2).transpose(0, 1)
    out = torch.empty(packed_nbytes(out_features, in_features), dtype=torch.uint8)
    split = out_features * in_features // 2
    out[:split].copy_(packed_codes.reshape(-1))
    out[split:].view(torch.bfloat16).view(scale_zero.shape).copy_(scale_zero)
    return out


def int4pack_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int
) -> torch.Tensor:
    """`x @ W.T` for a weight `repack_q4_k` packed, `x [..., in]`; bfloat16 inside, x's dtype out."""
    if packed.device.type != "cpu":
        raise ValueError(f"int4pack experts are computed on the CPU only, not on {packed.device}.")
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(out_features, in_features):
        raise ValueError(f"int4pack bytes do not hold a {out_features}×{in_features} weight")
    flat = packed.reshape(-1)
    split = out_features * in_features // 2
    codes = flat[:split].view(out_features, in_features // 2)
    scale_zero = flat[split:].view(torch.bfloat16).view(in_features // GROUP, out_features, 2)
    tokens = x.reshape(-1, in_features).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(tokens, codes, GROUP, scale_zero)
    return y.to(x.dtype).view(*x.shape[:-1], out_features)
