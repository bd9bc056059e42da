"""`x @ W.T` straight from K-quant blocks (Q4_K, Q6_K: llama.cpp's Q4_K_M), in float32.

Contract: `q4_k_linear` and `q6_k_linear` take `x [T, in]` (float32), the fields of the
weight's blocks (`engine.formats.gguf.blocks.split_fields` of `[rows * blocks a row, block
bytes]`) and the row count, and return exactly `F.linear(x, W)` for `W [out, in]` as
`blocks.dequantize` builds it: the same float32 operations on each weight, in the file's
column order, so the result is bit for bit the same. They are what a decode step spends its
time in on the CPU: per token, every used expert's three matrices.

How, and why: each float32 pass over an expert's matrix costs about as much as the one-token
matmul itself, and a freshly allocated matrix more (page faults). So the weight is built in a
reused buffer (`_scratch`, one per thread; plain allocations off the CPU): uint8 codes in the
file's order, converted once, then scaled in place. Nibbles are split by whole-tensor ops and
copied into the interleave (an `out=` into the strided interleave is slower); Q6_K's
`q − 32` is taken in uint8 (it wraps to its int8 value). Rejected: `addcmul` for `q·s − m`
(slower and not bit-exact: it fuses), a broadcast multiply of uint8 codes by float scales
(slower than convert-then-scale), the mins as a small matmul of x's sub-block
sums and columns in a cheaper order (sums in another order: 3e-5 off on wide-range scales).

Experts computed on the CPU do not come here for Q6_K, nor for Q4_K in bfloat16 runs: the store
repacks them at load for faster kernels (`engine.formats.gguf.repack`).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

_scratch = threading.local()


def scratch_buffer(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A reused work buffer of `shape` on the CPU (the largest asked for is kept, per thread);
    a fresh tensor elsewhere, where the caching allocator already reuses memory."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    numel = math.prod(shape)
    buffer = buffers.get((name, dtype))
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
            buffer = buffers[(name, dtype)] = torch.empty(numel, dtype=dtype)
    return buffer[:numel].view(shape)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins packed in 12 bytes -> float32 [n, 8] each."""
    d, m, m_d = scales.view(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def q4_k_linear(x: torch.Tensor, fields: dict[str, torch.Tensor], out_features: int) -> torch.Tensor:
    """`x @ W.T` for Q4_K blocks: 8 sub-blocks of 32 a block, sub-block 2g+h in nibble h of bytes 32g.."""
    n = fields["qs"].shape[0]
    sc, mn = k_scale_min(fields["scales"])
    qs = fields["qs"].view(n, 4, 1, 32)  # [n, g, 1, byte]
    codes = scratch_buffer("codes", (n, 4, 2, 32), torch.uint8, x.device)  # [n, g, h, byte]: the file's order
    # whole-tensor ops, then copies into the interleave: an `out=` into it is slower
    codes[:, :, :1].copy_(qs & 0xF)
    codes[:, :, 1:].copy_(qs >> 4)
    weight = scratch_buffer("weight", (n, 8, 32), torch.float32, x.device)
    weight.copy_(codes.view(n, 8, 32))
    weight.mul_((fields["d"] * sc).unsqueeze(-1)).sub_((fields["dmin"] * mn).unsqueeze(-1))
    return F.linear(x, weight.view(out_features, -1))


def q6_k_linear(x: torch.Tensor, fields: dict[str, torch.Tensor], out_features: int) -> torch.Tensor:
    """`x @ W.T` for Q6_K blocks: quarter k of each half takes nibble k//2 of `ql[32·(k%2)..]` and
    bits 2k of `qh`; 16 sub-blocks of 16 with signed 8-bit scales."""
    n = fields["ql"].shape[0]
    ql, qh = fields["ql"].view(n, 2, 2, 32), fields["qh"].view(n, 2, 32)  # [n, half, k%2, l], [n, half, l]
    codes = scratch_buffer("codes", (n, 2, 2, 2, 32), torch.uint8, x.device)  # [n, half, k//2, k%2, l]
    torch.bitwise_and(ql, 0xF, out=codes[:, :, 0])
    torch.bitwise_right_shift(ql, 4, out=codes[:, :, 1])
    quarters = codes.view(n, 2, 4, 32)
    for k in range(4):  # the two high bits of quarter k: bits 2k, 2k+1 of qh, moved to bits 4, 5
        high = qh << (4 - 2 * k) if k < 2 else qh >> (2 * k - 4)
        quarters[:, :, k].bitwise_or_(high.bitwise_and_(0x30))
    signed = codes.sub_(32).view(torch.int8)  # q − 32, two's complement
    weight = scratch_buffer("weight", (n, 16, 16), torch.float32, x.device)
    weight.copy_(signed.view(n, 16, 16))
    weight.mul_((fields["d"] * fields["scales"].float()).view(n, 16, 1))
    return F.linear(x, weight.view(out_features, -1))
