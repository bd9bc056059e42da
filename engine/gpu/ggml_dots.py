"""Device code of the fused kernels: rows of GGUF blocks dequantized and dotted with x, per type.

`_row_dots(rows, x_ptr, n_cols, GGML_TYPE, BLOCK_N)` is what `engine.gpu.kquant_moe`'s kernels call:
BLOCK_N rows of `n_cols` weights in `GGML_TYPE` blocks, each · x[:n_cols], a chunk of 256 columns at
a time in column order, accumulated in float32; `_row_bytes` is a row's size. The types are
`engine.gpu.registry.KQUANT_TYPES`: super-blocks of 256 (Q4_K, Q5_K, Q6_K, IQ4_XS) a chunk at a
time, blocks of 32 (Q8_0, IQ4_NL, MXFP4) eight at a time, the last chunk of a row masked.

Each weight is what `engine.formats.gguf.blocks.dequantize` builds, by the same float32 operations
in the same order: `q · (d · sc) − dmin · m` (Q4_K, Q5_K), `(q − 32) · (d · sc)` (Q6_K), `q · d`
(Q8_0), `kvalues[q] · d` (IQ4_NL), `kvalues[q] · (d · (sc − 32))` (IQ4_XS), `e2m1[q] · 2^(e − 128)`
with the table doubled (MXFP4). The 16-entry tables are looked up from int32 words of packed bytes
(a few selects and a shift): no memory, the same code in Triton's interpreter and in a cubin.
"""

from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType as QT

from engine.formats.gguf.blocks import E2M1_DOUBLED, IQ4_NL_VALUES

Q8_0: tl.constexpr = tl.constexpr(int(QT.Q8_0))
Q4_K: tl.constexpr = tl.constexpr(int(QT.Q4_K))
Q5_K: tl.constexpr = tl.constexpr(int(QT.Q5_K))
Q6_K: tl.constexpr = tl.constexpr(int(QT.Q6_K))
IQ4_NL: tl.constexpr = tl.constexpr(int(QT.IQ4_NL))
IQ4_XS: tl.constexpr = tl.constexpr(int(QT.IQ4_XS))
MXFP4: tl.constexpr = tl.constexpr(int(QT.MXFP4))


def _packed_words(values: tuple[int, ...], bias: int) -> tuple[tl.constexpr, ...]:
    """A 16-entry table as four int32 words (two's complement), entry i + bias in byte i % 4 of word
    i // 4: what `_table16` reads."""
    biased = [v + bias for v in values]
    assert len(biased) == 16 and all(0 <= b < 256 for b in biased), "16 entries of a byte each"
    words = [sum(b << (8 * i) for i, b in enumerate(biased[w : w + 4])) for w in range(0, 16, 4)]
    return tuple(tl.constexpr(w - (1 << 32) if w >= 1 << 31 else w) for w in words)


IQ4_BIAS: tl.constexpr = tl.constexpr(-min(IQ4_NL_VALUES))
IQ4_0, IQ4_1, IQ4_2, IQ4_3 = _packed_words(IQ4_NL_VALUES, IQ4_BIAS.value)
E2M1_BIAS: tl.constexpr = tl.constexpr(-min(E2M1_DOUBLED))
E2M1_0, E2M1_1, E2M1_2, E2M1_3 = _packed_words(E2M1_DOUBLED, E2M1_BIAS.value)


@triton.jit
def _f16(low, high):
    """The float16 of little-endian bytes `low`, `high` (any shape), as float32 (exact)."""
    bits = low.to(tl.uint16) | (high.to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _table16(q, w0, w1, w2, w3, bias):
    """Entry `q` (int32, 0..15) of the table packed in `w0..w3` by `_packed_words`, as int32."""
    word = tl.where(q < 8, tl.where(q < 4, w0, w1), tl.where(q < 12, w2, w3))
    return ((word >> (8 * (q & 3))) & 255) - bias


@triton.jit
def _k_quant_dot(block, x_ptr, FIVE_BIT: tl.constexpr):
    """`block [BN, 1, 1]`: each row's Q4_K super-block (d | dmin | scales[12] | qs[128]) or, with
    FIVE_BIT, Q5_K's (d | dmin | scales[12] | qh[32] | qs[128]); `x_ptr` its 256 columns of x.
    Sub-block j = 2g + h is nibble h of qs[32g .. 32g + 31], Q5_K's fifth bit bit j of qh[0 .. 31]."""
    sub = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
    lane = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    d = _f16(tl.load(block), tl.load(block + 1))
    dmin = _f16(tl.load(block + 2), tl.load(block + 3))
    # 8 six-bit scales and mins in 12 bytes (gguf.blocks.k_scale_min): a = byte j, b = byte j + 4,
    # c = byte j - 4 (for the upper four)
    a = tl.load(block + 4 + sub).to(tl.int32)
    b = tl.load(block + 8 + sub).to(tl.int32)
    c = tl.load(block + 4 + (sub & 3)).to(tl.int32)
    lower = sub < 4
    sc = tl.where(lower, a & 63, (b & 15) | ((c >> 2) & 48)).to(tl.float32)
    mn = tl.where(lower, b & 63, (b >> 4) | ((a >> 2) & 48)).to(tl.float32)
    if FIVE_BIT:
        qs = tl.load(block + 48 + 32 * (sub // 2) + lane).to(tl.int32)  # [BN, 8, 32]
        # qh read as [BN, 8, 32] (each byte once per sub-block, from the cache): loaded in qs's
        # layout, where a broadcast [BN, 1, 32] would move both through shared memory
        qh = tl.load(block + 16 + 0 * sub + lane).to(tl.int32)
        q = ((qs >> (4 * (sub % 2))) & 15) | (((qh >> sub) & 1) << 4)
    else:
        qs = tl.load(block + 16 + 32 * (sub // 2) + lane).to(tl.int32)  # [BN, 8, 32]
        q = (qs >> (4 * (sub % 2))) & 15
    w = q.to(tl.float32) * (d * sc) - dmin * mn
    x = tl.load(x_ptr + 32 * sub + lane).to(tl.float32)
    return tl.sum(tl.sum(w * x, axis=2), axis=1)


@triton.jit
def _q6_k_dot(block, x_ptr, BLOCK_N: tl.constexpr):
    """`block [BN, 1, 1]`: each row's Q6_K super-block (ql[128] | qh[64] | scales:i8[16] | d), a half
    of 128 weights at a time (half the registers); weight r of half h takes nibble r // 64 of
    ql[64h + r % 64] and bits 2(r // 32) of qh[32h + r % 32]; 16 sub-blocks of 16."""
    d = _f16(tl.load(block + 208), tl.load(block + 209))
    sub = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]: the half's sub-blocks
    r = 16 * sub + tl.arange(0, 16)[None, None, :]  # [1, 8, 16]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for half in range(2):
        ql = tl.load(block + 64 * half + r % 64).to(tl.int32)
        qh = tl.load(block + 128 + 32 * half + r % 32).to(tl.int32)
        q = (((ql >> (4 * (r // 64))) & 15) | (((qh >> (2 * (r // 32))) & 3) << 4)).to(tl.float32)
        sc = tl.load(block + 192 + 8 * half + sub).to(tl.int8, bitcast=True).to(tl.float32)
        w = (q - 32.0) * (d * sc)
        x = tl.load(x_ptr + 128 * half + r).to(tl.float32)
        acc += tl.sum(tl.sum(w * x, axis=2), axis=1)
    return acc


@triton.jit
def _iq4_xs_dot(block, x_ptr):
    """`block [BN, 1, 1]`: each row's IQ4_XS super-block (d | scales_h[2] | scales_l[4] | qs[128]);
    sub-block j's six-bit scale is nibble j % 2 of scales_l[j // 2] and bits 2(j % 4) of
    scales_h[j // 4]; its weight l the non-linear value of nibble l // 16 of qs[16j + l % 16]."""
    sub = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
    lane = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    d = _f16(tl.load(block), tl.load(block + 1))
    low = tl.load(block + 4 + sub // 2).to(tl.int32)
    high = tl.load(block + 2 + sub // 4).to(tl.int32)
    six_bit = ((low >> (4 * (sub % 2))) & 15) | (((high >> (2 * (sub % 4))) & 3) << 4)
    scale = d * (six_bit.to(tl.float32) - 32.0)
    qs = tl.load(block + 8 + 16 * sub + lane % 16).to(tl.int32)  # [BN, 8, 32]
    q = (qs >> (4 * (lane // 16))) & 15
    w = _table16(q, IQ4_0, IQ4_1, IQ4_2, IQ4_3, IQ4_BIAS).to(tl.float32) * scale
    x = tl.load(x_ptr + 32 * sub + lane).to(tl.float32)
    return tl.sum(tl.sum(w * x, axis=2), axis=1)


@triton.jit
def _nibble(qs_ptr, lane, valid):
    """Weight `lane` (0..31) of a 32-weight block whose 16 bytes at `qs_ptr` hold weight j in the low
    nibble of byte j and weight j + 16 in its high nibble (IQ4_NL, MXFP4): its code, int32."""
    qs = tl.load(qs_ptr + lane % 16, mask=valid, other=0).to(tl.int32)
    return (qs >> (4 * (lane // 16))) & 15


@triton.jit
def _blocks_of_32_dot(row, chunk, x_ptr, n_blocks, GGML_TYPE: tl.constexpr):
    """`row [BN, 1, 1]`: each row's first block of 32 weights (Q8_0: d | qs:i8[32], IQ4_NL:
    d | qs[16], MXFP4: e8m0 | qs[16]); blocks 8·chunk .. 8·chunk + 7 of `n_blocks` (a row need not
    fill the last chunk) dotted with x."""
    blk = 8 * chunk + tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
    lane = tl.arange(0, 32)[None, None, :]
    valid = blk < n_blocks
    if GGML_TYPE == Q8_0:
        block = row + 34 * blk
        d = _f16(tl.load(block, mask=valid, other=0), tl.load(block + 1, mask=valid, other=0))
        q = tl.load(block + 2 + lane, mask=valid, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * d
    elif GGML_TYPE == IQ4_NL:
        block = row + 18 * blk
        d = _f16(tl.load(block, mask=valid, other=0), tl.load(block + 1, mask=valid, other=0))
        q = _nibble(block + 2, lane, valid)
        w = _table16(q, IQ4_0, IQ4_1, IQ4_2, IQ4_3, IQ4_BIAS).to(tl.float32) * d
    else:
        tl.static_assert(GGML_TYPE == MXFP4, "one of engine.gpu.registry.KQUANT_TYPES")
        block = row + 17 * blk
        # the e8m0 scale halved (the table is doubled): 2^(e − 128) as float32 bits, subnormal for e < 2
        e = tl.load(block, mask=valid, other=0).to(tl.int32)
        scale = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        q = _nibble(block + 1, lane, valid)
        w = _table16(q, E2M1_0, E2M1_1, E2M1_2, E2M1_3, E2M1_BIAS).to(tl.float32) * scale
    x = tl.load(x_ptr + 32 * blk + lane, mask=valid, other=0.0).to(tl.float32)
    return tl.sum(tl.sum(w * x, axis=2), axis=1)


@triton.jit
def _row_dots(rows, x_ptr, n_cols, GGML_TYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """`rows [BLOCK_N]`: byte pointers to rows of `n_cols` weights in `GGML_TYPE` blocks; each
    row · x[:n_cols], float32, accumulated a chunk of 256 columns at a time in column order."""
    row = rows[:, None, None]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if GGML_TYPE == Q4_K:
        for chunk in range(0, n_cols // 256):
            acc += _k_quant_dot(row + 144 * chunk, x_ptr + 256 * chunk, False)
    elif GGML_TYPE == Q5_K:
        for chunk in range(0, n_cols // 256):
            acc += _k_quant_dot(row + 176 * chunk, x_ptr + 256 * chunk, True)
    elif GGML_TYPE == Q6_K:
        for chunk in range(0, n_cols // 256):
            acc += _q6_k_dot(row + 210 * chunk, x_ptr + 256 * chunk, BLOCK_N)
    elif GGML_TYPE == IQ4_XS:
        for chunk in range(0, n_cols // 256):
            acc += _iq4_xs_dot(row + 136 * chunk, x_ptr + 256 * chunk)
    else:  # Q8_0, IQ4_NL, MXFP4 (_blocks_of_32_dot asserts it)
        n_blocks = n_cols // 32
        for chunk in range(0, tl.cdiv(n_blocks, 8)):
            acc += _blocks_of_32_dot(row, chunk, x_ptr, n_blocks, GGML_TYPE)
    return acc


@triton.jit
def _row_bytes(n_cols, GGML_TYPE: tl.constexpr):
    """Bytes of a row of `n_cols` weights (engine.formats.gguf.blocks.row_bytes)."""
    if GGML_TYPE == Q4_K:
        return n_cols // 256 * 144
    elif GGML_TYPE == Q5_K:
        return n_cols // 256 * 176
    elif GGML_TYPE == Q6_K:
        return n_cols // 256 * 210
    elif GGML_TYPE == IQ4_XS:
        return n_cols // 256 * 136
    elif GGML_TYPE == Q8_0:
        return n_cols // 32 * 34
    elif GGML_TYPE == IQ4_NL:
        return n_cols // 32 * 18
    else:
        return n_cols // 32 * 17  # MXFP4
