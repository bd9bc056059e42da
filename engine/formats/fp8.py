"""FP8 weights as the published checkpoints hold them: e4m3 values and float32 block scales.

Qwen3-*-FP8 and DeepSeek-V3 store a Linear weight `W [out, in]` as `weight` (F8_E4M3) and
`weight_scale_inv` (F32 `[ceil(out/b_out), ceil(in/b_in)]`, block 128 × 128; config.json:
`quantization_config.quant_method == "fp8"`, `weight_block_size`). Some checkpoints have one
scale for the whole matrix, `weight_scale` of one element: that is a single block as large as
the matrix. Either way

    W[r, c] = float(weight[r, c]) * scale_inv[r // b_out, c // b_in]

(`scale_inv` multiplies: the name says it is the inverse of the quantizing scale). An expert
field keeps the bytes and the scales (`Fp8Weight`); `linear` dequantizes where it computes, with
plain torch ops, the same on every device, so it equals `dequantize` followed by `F.linear`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn


class Fp8Weight(NamedTuple):
    """The view of an FP8 field: its `(out, in)` e4m3 values and their scales."""

    data: torch.Tensor  # float8_e4m3fn [out, in]
    scale_inv: torch.Tensor  # float32 [ceil(out / b_out), ceil(in / b_in)]
    block: tuple[int, int]  # (b_out, b_in)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: how `engine.formats.int_quant.linear` computes this format."""
        return linear(x, self)


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The scales of a `(out, in)` weight in blocks of `(b_out, b_in)`: one per block, partial ones too."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def dequantize(weight: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight `[out, in]` in `dtype`: each value times its block's scale, in float32."""
    data, scale = weight.data, weight.scale_inv.float()
    (out, columns), (b_out, b_in) = data.shape, weight.block
    if out % b_out == 0 and columns % b_in == 0:  # whole blocks: a broadcast, no expanded scales
        blocks = data.view(out // b_out, b_out, columns // b_in, b_in).float()
        return (blocks * scale[:, None, :, None]).view(out, columns).to(dtype)
    expanded = scale.repeat_interleave(b_out, 0).repeat_interleave(b_in, 1)[:out, :columns]
    return (data.float() * expanded).to(dtype)


def linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """`x @ W.T` for an FP8 weight held `(out, in)`, whatever the family's own orientation.

    Half-precision elementwise ops are slow on CPU: there the product is taken in float32."""
    work = torch.float32 if x.device.type == "cpu" else x.dtype
    return F.linear(x.to(work), dequantize(weight, work)).to(x.dtype)
