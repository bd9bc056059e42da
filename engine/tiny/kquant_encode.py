"""Quantizing a matrix into ggml blocks, for the GGUF files the tests write.

gguf-py 0.19 dequantizes K-quants but cannot quantize them (NotImplementedError for Q2_K..Q6_K), so
Q4_K, Q5_K and Q6_K blocks are encoded here: a plain min/max fit per block, not llama.cpp's search (any
valid block serves a test: the reference dequantizes the very same bytes). Other types go to
gguf-py's own quantizers.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType

QT = GGMLQuantizationType


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num, den = np.broadcast_arrays(num, den)
    return np.divide(num, den, out=np.zeros(num.shape, np.float32), where=den != 0)


def _k_fit(rows: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Q4_K's and Q5_K's fit (codes 0..top): d, dmin, the 8 six-bit scales and mins a block, and the
    codes `[n, 8, 32]`, uint8."""
    blocks = rows.reshape(-1, 8, 32)
    low = np.minimum(blocks.min(axis=-1), 0.0)  # value = d*sc*q - dmin*m, with m >= 0
    scale = (blocks.max(axis=-1) - low) / top
    d = (scale.max(axis=-1, keepdims=True) / 63.0).astype(np.float16)
    dmin = (-low.min(axis=-1, keepdims=True) / 63.0).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-low, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    shifted = blocks + (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.rint(_safe_div(shifted, (d.astype(np.float32) * sc)[..., None])), 0, top)
    return d, dmin, sc, mn, q.astype(np.uint8)


def _k_head(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray) -> list[np.ndarray]:
    """d, dmin and the 12 bytes of packed scales and mins that open a Q4_K or Q5_K block."""
    return [
        d.view(np.uint8),
        dmin.view(np.uint8),
        sc[:, :4] | ((sc[:, 4:] & 0x30) << 2),
        mn[:, :4] | ((mn[:, 4:] & 0x30) << 2),
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
    ]


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Codes `[n, 8, 32]` as 128 bytes a block: sub-block 2c in the low nibbles of bytes 32c.., 2c+1
    in the high ones."""
    q = q.reshape(-1, 4, 2, 32) & 0x0F
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K, 144 bytes a block: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks of
    32, then 128 bytes of nibbles."""
    d, dmin, sc, mn, q = _k_fit(rows, 15)
    return np.concatenate([*_k_head(d, dmin, sc, mn), _nibbles(q)], axis=-1)


def _q5_k(rows: np.ndarray) -> np.ndarray:
    """Q5_K, 176 bytes a block: Q4_K's head, then 32 bytes of fifth bits (bit j of byte l: weight l
    of sub-block j), then the low nibbles as Q4_K packs them."""
    d, dmin, sc, mn, q = _k_fit(rows, 31)
    fifth = (q >> 4).astype(np.uint8)  # [n, 8, 32]
    qh = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    return np.concatenate([*_k_head(d, dmin, sc, mn), qh, _nibbles(q)], axis=-1)


def _q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K, 210 bytes a block: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one
    per 16 values), f16 d; value = d * scale * (q - 32)."""
    blocks = rows.reshape(-1, 16, 16)
    peak = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    scale = peak / -32.0  # as ggml: the largest magnitude maps to -32
    d = (np.abs(scale).max(axis=-1, keepdims=True) / 127.0).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32))), -128, 127).astype(np.int8)
    q = np.clip(np.rint(_safe_div(blocks, (d.astype(np.float32) * sc)[..., None])), -32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [half, row of 32 within the half, value]
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8)], axis=-1)


_K_ENCODERS = {QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k}


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.quantize`, plus Q4_K, Q5_K and Q6_K; rows (the last axis) must fill whole blocks."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % block_size:
        raise ValueError(f"a {qtype.name} row needs a multiple of {block_size} values, not {data.shape[-1]}")
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype not in _K_ENCODERS:
        return gguf.quants.quantize(data, qtype)
    blocks = _K_ENCODERS[qtype](data.reshape(-1, block_size))
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // block_size * type_size)
