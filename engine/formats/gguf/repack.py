"""GGUF expert weights repacked once, at load, into forms the CPU computes fast.

Contract: `packing_for(ggml_type, out, in, dtype)` names the packing a weight of the file gets on
the CPU for a model computing in `dtype` (None: it stays in the file's blocks);
`repack(packing, blocks, out, in)` turns the file's bytes of one `[out, in]` weight into
`packed_nbytes(packing, out, in)` bytes; `repacked_linear(packing, x, packed, out, in)` is
`x @ W.T` from them, in x's dtype. Each packing is a layout of plain arrays, back to back:

    INT4PACK   Q4_K, bfloat16 runs   codes as torch's `_convert_weight_to_int4pack_for_cpu`
                                     lays them out (uint8 [out, in/2], this CPU's kernel layout),
                                     then bfloat16 scale and zero [in/32, out, 2]   160 B / 256 w
    Q6_K_INT8  Q6_K, any dtype       int8 codes q−32 [out, in], int8 sub-block scales
                                     [out, in/16], f16 d [out, in/256]             274 B / 256 w

INT4PACK goes through `torch.ops.aten._weight_int4pack_mm_for_cpu`. Q4_K's `d·sc·q − dmin·m`
per 32-weight sub-block is the kernel's `(q − 8)·scale + zero` with `scale = d·sc`,
`zero = 8·scale − dmin·m`, but the kernel takes scales in x's dtype and has no vectorised
float32 path on x86 (a scalar loop), so it serves bfloat16 runs only: scale and zero rounded to
8 bits of mantissa (a weight moves by about what storing it in bfloat16 does), float32
accumulation, output rounded to bfloat16. Float32 runs keep
`kquant_matmul`'s bit-exact rebuild of Q4_K. Computing scale and zero from the Q4_K header at
each call would cost more than the kernel itself, hence stored: 1.11× Q4_K's bytes.

Q6_K_INT8 rebuilds the float32 weight bit for bit as `kquant_matmul.q6_k_linear` does (int8
codes converted, times float32 `d·sc`), without unpacking 6-bit codes from two bit planes
(~10 passes over the matrix), `blocks.CHUNK_BYTES` of rows at a time: exact in float32,
the exact product rounded once in bfloat16; 1.30× Q6_K's bytes.

`place` writes a weight of the file into its row in any packing, ggml's interleaved rows included
(`engine.ggml.interleave`).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from engine.formats.gguf.blocks import CHUNK_BYTES, row_bytes, unpack_bits
from engine.formats.gguf.kquant_matmul import k_scale_min, scratch_buffer
from engine.ggml import interleave as ggml_interleave
from engine.model.gguf_file import DENSE_TYPES

log = logging.getLogger(__name__)
Q = GGMLQuantizationType
INT4PACK = "int4pack"  # an `ExpertField.packing`
Q6_K_INT8 = "q6_k_int8"
GGML = "ggml"  # the file's blocks as they are, computed by llama.cpp's kernels (`--kernels ggml`)
GGML_X8 = "ggml-x8"  # the same blocks with 8 rows interleaved, as llama.cpp computes them on this CPU
GGML_PACKINGS = frozenset({GGML, GGML_X8})  # the ones ggml computes (engine.ggml.kernels)
# float types ggml computes too: bfloat16 (float16) weights times activations rounded to bfloat16
# (float16), summed in float32 as torch's bfloat16 matmul sums, at llama.cpp's speed
GGML_FLOATS = frozenset({Q.BF16, Q.F16})
GROUP = 32  # int4pack: weights per scale and zero, one Q4_K sub-block
_N_BLOCK = 16  # int4pack: the kernel takes its output rows in blocks of 16, 32, 48 or 64
_SOURCE = {INT4PACK: Q.Q4_K, Q6_K_INT8: Q.Q6_K}


def packing_for(
    ggml_type: int,
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
    kernels: str = "exact",
    interleave: bool = False,
) -> str | None:
    """The packing a CPU model computing in `dtype` with `kernels` gives this weight; None keeps the
    file's blocks for the exact dequantizing path. `interleave`: ggml's kernels read the weight
    where it lies (in place) and may have it in llama.cpp's interleaved rows (ggml_interleave)."""
    if kernels == "ggml":
        if ggml_type in DENSE_TYPES and ggml_type not in GGML_FLOATS:
            return None
        return GGML_X8 if interleave and ggml_interleave.interleaves(ggml_type, out_features) else GGML
    if ggml_type == Q.Q4_K and dtype == torch.bfloat16 and out_features % _N_BLOCK == 0:
        return INT4PACK
    if ggml_type == Q.Q6_K:
        return Q6_K_INT8
    return None


def packed_nbytes(packing: str, out_features: int, in_features: int) -> int:
    """Bytes of a repacked `[out, in]` weight."""
    weights = out_features * in_features
    if packing == INT4PACK:
        return weights // 2 + weights // GROUP * 2 * 2
    if packing == Q6_K_INT8:
        return weights + weights // 16 + weights // 256 * 2
    raise ValueError(f"Unknown packing {packing!r}.")


def repack(packing: str, blocks: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The file's blocks of one `[out, in]` weight (uint8) -> its `packing` bytes (a new tensor)."""
    source = _SOURCE.get(packing)
    if source is None or packing_for(source, out_features, in_features, torch.bfloat16) != packing:
        raise ValueError(f"A {out_features}×{in_features} weight has no {packing} form.")
    expected = row_bytes(source, in_features) * out_features
    if blocks.dtype != torch.uint8 or blocks.numel() != expected:
        raise ValueError(
            f"{source.name} {out_features}×{in_features} takes {expected} bytes; got {blocks.numel()}."
        )
    out = torch.empty(packed_nbytes(packing, out_features, in_features), dtype=torch.uint8)
    fill = _repack_q4_k if packing == INT4PACK else _repack_q6_k
    fill(blocks.reshape(out_features * in_features // 256, -1), out, out_features, in_features)
    return out


def place(
    packing: str | None,
    target: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    out_features: int,
    in_features: int,
) -> None:
    """Write one `[out, in]` weight, given in the file's blocks, into `target` in `packing`: the same
    bytes (None, GGML), interleaved as llama.cpp has them on this CPU (GGML_X8) or repacked."""
    if packing == GGML_X8:
        ggml_interleave.interleave_into(target, blocks, ggml_type, out_features, in_features)
    elif packing in (None, GGML):
        target.copy_(blocks)
    else:
        target.copy_(repack(packing, blocks, out_features, in_features).view(target.shape))


def _repack_q4_k(blocks: torch.Tensor, out: torch.Tensor, out_features: int, in_features: int) -> None:
    split = out_features * in_features // 2
    qs = blocks[:, 16:].reshape(out_features, in_features // 2)  # [n, 144]: d | dmin | scales[12] | qs
    row_block = _row_block()
    if row_block is not None and out_features % row_block == 0:
        _pack_q4_k_nibbles(qs, row_block, out[:split])
    else:
        out[:split].copy_(
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(_q4_k_codes(qs).int(), 1).view(-1)
        )
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    sc, mn = k_scale_min(blocks[:, 4:16].contiguous())  # [n, 8] each
    scale = d * sc  # as ggml: float32 d·sc, then dmin·m
    zero = 8 * scale - dmin * mn
    # [in/32, out, 2]: the kernel reads one group's scales and zeros for a block of rows at once
    scale_zero = out[split:].view(torch.bfloat16).view(in_features // GROUP, out_features, 2)
    scale_zero[..., 0].copy_(scale.view(out_features, -1).T)
    scale_zero[..., 1].copy_(zero.view(out_features, -1).T)


def _q4_k_codes(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's packed nibbles `[out, in/2]` -> uint8 codes `[out, in]` in weight order (sub-block
    2g+h of a block: nibble h of its bytes 32g..32g+31)."""
    grouped = qs.reshape(-1, 4, 1, 32)
    return torch.cat([grouped & 0xF, grouped >> 4], dim=2).reshape(qs.shape[0], -1)


def _pack_q4_k_nibbles(qs: torch.Tensor, row_block: int, out: torch.Tensor) -> None:
    """Q4_K's nibbles `[out, in/2]` written into `out` (uint8, as many bytes) in the int4pack layout
    of a CPU whose kernel takes `row_block` rows at a time (32 with AVX2, 64 with AVX-512): per
    block of rows and per weight column, the 16 rows of lane i in the low nibbles and those of lane
    i + lanes/2 in the high ones (torch's int4mm_kernel.cpp). Nibbles move from byte to byte
    without a code tensor in between; torch's own op walks int32 codes down columns, far slower."""
    rows, half_in = qs.shape
    blocks, lanes = rows // row_block, row_block // 16
    # [row block, lane, d, Q4_K block, group g, byte l]: weight column (block, g, h, l) is nibble h
    nibbles = qs.view(blocks, lanes, 16, half_in // 128, 4, 32)
    low, high = nibbles[:, : lanes // 2], nibbles[:, lanes // 2 :]  # [blocks, pair, d, ...]
    target = out.view(blocks, half_in // 128, 4, 2, 32, lanes // 2, 16)  # [blocks, k = (b, g, h, l), pair, d]
    target[:, :, :, 0].copy_(((low & 0xF) | (high << 4)).permute(0, 3, 4, 5, 1, 2))
    target[:, :, :, 1].copy_(((low >> 4) | (high & 0xF0)).permute(0, 3, 4, 5, 1, 2))


@functools.cache
def _row_block() -> int | None:
    """The row block `_pack_q4_k_nibbles` reproduces torch's own packing with on this CPU, checked
    once on probe nibbles; None (use the op) where neither does."""
    probe = torch.randint(0, 256, (128, 128), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(_q4_k_codes(probe).int(), 1).reshape(-1)
    for row_block in (32, 64):
        packed = torch.empty_like(probe).view(-1)
        _pack_q4_k_nibbles(probe, row_block, packed)
        if torch.equal(packed, expected):
            return row_block
    log.warning("int4pack: this CPU's packing is not one MoE Chat knows; repacking with torch's slower op")
    return None


def _repack_q6_k(blocks: torch.Tensor, out: torch.Tensor, out_features: int, in_features: int) -> None:
    n = blocks.shape[0]  # [n, 210]: ql[128] | qh[64] | scales i8[16] | d f16
    codes = unpack_bits(blocks[:, :128], 4, 64).bitwise_or_(unpack_bits(blocks[:, 128:192], 2, 32) << 4)
    weights = out_features * in_features
    out[:weights].copy_(codes.sub_(32).view(-1))  # q − 32 wraps to its int8 value
    out[weights : weights + n * 16].copy_(blocks[:, 192:208].reshape(-1))
    out[weights + n * 16 :].copy_(blocks[:, 208:210].reshape(-1))


def repacked_linear(
    packing: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, in_features: int
) -> torch.Tensor:
    """`x @ W.T` for a weight `repack` packed, `x [..., in]`, in x's dtype."""
    if packed.device.type != "cpu":
        raise ValueError(f"Repacked ({packing}) experts compute on the CPU only, not on {packed.device}.")
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(packing, out_features, in_features):
        raise ValueError(f"{packing} bytes do not hold a {out_features}×{in_features} weight")
    tokens, flat = x.reshape(-1, in_features), packed.reshape(-1)
    if packing == INT4PACK:
        split = out_features * in_features // 2
        codes = flat[:split].view(out_features, in_features // 2)
        scale_zero = flat[split:].view(torch.bfloat16).view(in_features // GROUP, out_features, 2)
        tokens = tokens.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(tokens, codes, GROUP, scale_zero)
    else:
        y = _q6_k_int8_linear(tokens.float(), flat, out_features, in_features)
    return y.to(x.dtype).view(*x.shape[:-1], out_features)


def _q6_k_int8_linear(
    x: torch.Tensor, flat: torch.Tensor, out_features: int, in_features: int
) -> torch.Tensor:
    weights, subs = out_features * in_features, in_features // 16
    codes = flat[:weights].view(torch.int8).view(out_features, subs, 16)
    sub_scales = flat[weights : weights + weights // 16].view(torch.int8).view(out_features, -1, 16)
    d = flat[weights + weights // 16 :].view(torch.float16).view(out_features, -1, 1)
    step = max(1, CHUNK_BYTES // (4 * in_features))  # rows whose float32 weight stays in cache
    parts = []
    for start in range(0, out_features, step):
        rows = slice(start, min(start + step, out_features))
        weight = scratch_buffer("weight", (rows.stop - start, subs, 16), torch.float32, x.device)
        weight.copy_(codes[rows])
        weight.mul_((d[rows].float() * sub_scales[rows].float()).view(-1, subs, 1))  # as ggml: d·sc
        parts.append(F.linear(x, weight.view(-1, in_features)))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
