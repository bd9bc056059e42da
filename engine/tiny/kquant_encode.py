"""Quantizing a matrix into ggml blocks, for the GGUF files the tests write.

gguf-py 0.19 dequantizes K-quants but cannot quantize them (NotImplementedError for Q2_K..Q6_K), so
Q4_K and Q6_K blocks are encoded here: a plain min/max fit per block, not llama.cpp's search (any
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


def _q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K, 144 bytes a block: f16 d, f16 dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks of
    32, then 128 bytes of nibbles (sub-block 2c in the low nibbles of bytes 32c.., 2c+1 in the high)."""
    blocks = rows.reshape(-1, 8, 32)
    low = np.minimum(blocks.min(axis=-1), 0.0)  # value = d*sc*q - dmin*m, with m >= 0
    scale = (blocks.max(axis=-1) - low) / 15.0
    d = (scale.max(axis=-1, keepdims=True) / 63.0).astype(np.float16)
    dmin = (-low.min(axis=-1, keepdims=True) / 63.0).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32))), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-low, dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    shifted = blocks + (dmin.astype(np.float32) * mn)[..., None]
    q = np.clip(np.rint(_safe_div(shifted, (d.astype(np.float32) * sc)[..., None])), 0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    packed_scales = [
        sc[:, :4] | ((sc[:, 4:] & 0x30) << 2),
        mn[:, :4] | ((mn[:, 4:] & 0x30) << 2),
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
    ]
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), *packed_scales, nibbles], axis=-1)


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


_K_ENCODERS = {QT.Q4_K: _q4_k, QT.Q6_K: _q6_k}


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.quantize`, plus Q4_K and Q6_K; rows (the last axis) must fill whole blocks."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % block_size:
        raise ValueError(f"a {qtype.name} row needs a multiple of {block_size} values, not {data.shape[-1]}")
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype not in _K_ENCODERS:
        return gguf.quants.quantize(data, qtype)
    blocks = _K_ENCODERS[qtype](data.reshape(-1, block_size))
    return blocks.reshape(*data.shape[:-1], data.shape[-1] // block_size * type_size)
