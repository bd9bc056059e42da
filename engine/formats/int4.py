"""Int4 weights as GPTQ and AWQ checkpoints publish them: packed int32 codes, zeros and fp16 scales.

A quantized Linear `W [out, in]` is stored transposed, input rows by output columns, in groups of
`group_size` inputs (`quantization_config.group_size`, usually 128):

- GPTQ (AutoGPTQ / GPTQModel, `quant_method: gptq`): `qweight` int32 `[in/8, out]`, 8 codes of one
  column packed along the input dim, low bits first (input `8r + j` is bits `4j..4j+3` of row r);
  `qzeros` int32 `[groups, out/8]` packed along the output dim, low bits first; `scales` fp16
  `[groups, out]`; `g_idx` int32 `[in]`, the group of each input (act-order, `desc_act: true`,
  permutes it; without it input i is in group `i // group_size`). Format "gptq" (v1, the historic
  one) stores each zero minus one, so a symmetric 4-bit zero of 8 is the nibble 7 (0x77777777);
  "gptq_v2" stores the zero itself.
- AWQ GEMM (AutoAWQ, `quant_method: awq`, `version: gemm`): `qweight` int32 `[in, out/8]`, 8 codes
  of one input packed along the output dim in AutoAWQ's interleaved order: nibble i of a word holds
  column `AWQ_ORDER[i]` of its 8; `qzeros` `[groups, out/8]` alike; `scales` fp16 `[groups, out]`.

- compressed-tensors `pack-quantized` (llm-compressor w4a16, `quant_method: compressed-tensors`): the
  weight's own orientation, `weight_packed` int32 `[out, in/8]`, 8 codes of one row packed along the
  input dim, low bits first, each the signed code plus 8; `weight_scale` `[out, groups]` (the model's
  dtype, usually bf16); asymmetric ones add `weight_zero_point` int32 `[out/8, groups]` packed along
  the output dim alike (CT); symmetric ones have none: their zero is the stored 8 (CT_SYM).

Either way `W[o, i] = (q[i, o] - z[g(i), o]) * s[g(i), o]`. An expert field keeps the checkpoint's
bytes (`Int4Weight`); `linear` dequantizes where it computes, with plain torch ops (shifts and masks),
the same on every device. A field made of stacked matrices (gate and up: `gate_up_proj`) has them
side by side on the output dim, and act-order keeps one `g_idx` row per matrix (`[parts, in]`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

GPTQ, GPTQ_V2, AWQ = "gptq", "gptq_v2", "awq"
# compressed-tensors pack-quantized, with and without zero points
CT, CT_SYM = "compressed-tensors", "compressed-tensors-sym"
FORMATS = (GPTQ, GPTQ_V2, AWQ, CT, CT_SYM)
ROW_MAJOR = (CT, CT_SYM)  # held (out, in): the output dim is the first of every packed tensor
PACK = 8  # 4-bit codes per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of a word is nibble AWQ_NIBBLE[c] (the inverse)


class Int4Weight(NamedTuple):
    """The view of an int4 field: the checkpoint's packed tensors, their format and `(out, in)`."""

    qweight: torch.Tensor  # int32: GPTQ [in/8, out], AWQ [in, out/8], CT [out, in/8]
    qzeros: torch.Tensor  # int32 [groups, out/8]; CT [out/8, groups], CT_SYM [0, groups]
    scales: torch.Tensor  # float16 [groups, out]; CT the checkpoint's dtype [out, groups]
    g_idx: torch.Tensor | None  # int32 [parts, in]: each input's group, per stacked matrix (act-order)
    format: str  # one of FORMATS
    shape: tuple[int, int]  # (out, in)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: how `engine.formats.int_quant.linear` computes this format."""
        return linear(x, self)


def packed_shapes(fmt: str, shape: tuple[int, int], groups: int) -> dict[str, tuple[int, int]]:
    """The shapes of `qweight`, `qzeros` and `scales` of a `(out, in)` weight in `groups` groups."""
    out, inputs = shape
    if fmt in ROW_MAJOR:
        zero_rows = out // PACK if fmt == CT else 0
        return {"qweight": (out, inputs // PACK), "qzeros": (zero_rows, groups), "scales": (out, groups)}
    qweight = (inputs, out // PACK) if fmt == AWQ else (inputs // PACK, out)
    return {"qweight": qweight, "qzeros": (groups, out // PACK), "scales": (groups, out)}


def output_dim(fmt: str) -> int:
    """The dim of `qweight`, `qzeros` and `scales` along which stacked matrices (gate, up) sit."""
    return 0 if fmt in ROW_MAJOR else -1


def groups(weight: Int4Weight) -> int:
    """How many groups of inputs the weight's scales have."""
    return weight.scales.shape[1 if weight.format in ROW_MAJOR else 0]


def unpack(words: torch.Tensor, dim: int) -> torch.Tensor:
    """The 4-bit codes of int32 `words`, 8 per word along `dim`, low bits first (int32, 0..15)."""
    dim = dim % words.dim()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    shifts = shifts.view([PACK] + [1] * (words.dim() - dim - 1))
    codes = (words.unsqueeze(dim + 1) >> shifts) & 0xF
    return codes.flatten(dim, dim + 1)


def _columns(words: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes packed along the last (output) dim, in column order."""
    codes = unpack(words, -1)
    if fmt != AWQ:
        return codes
    order = torch.tensor(AWQ_NIBBLE, device=words.device)
    return codes.unflatten(-1, (-1, PACK))[..., order].flatten(-2)


def codes(weight: Int4Weight) -> torch.Tensor:
    """The weight's codes, int32 `[in, out]` (CT: `[out, in]`, its own orientation)."""
    if weight.format in ROW_MAJOR:
        return unpack(weight.qweight, -1)
    if weight.format == AWQ:
        return _columns(weight.qweight, AWQ)
    return unpack(weight.qweight, 0)


def zeros(weight: Int4Weight) -> torch.Tensor:
    """The zero point of each group and column, int32 `[groups, out]` (v1's "+1" applied; CT:
    `[out, groups]`)."""
    if weight.format == CT_SYM:  # the signed codes' zero, as stored
        shape = (weight.shape[0], groups(weight))
        return torch.full(shape, 8, dtype=torch.int32, device=weight.qweight.device)
    if weight.format == CT:
        return unpack(weight.qzeros, 0)
    found = _columns(weight.qzeros, weight.format)
    return found + 1 if weight.format == GPTQ else found


def dequantize(weight: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight `[out, in]` in `dtype`: `(q - z) * s` per group, computed in float32."""
    if weight.format in ROW_MAJOR:
        return _dequantize_rows(weight, dtype)
    q, z, s = codes(weight), zeros(weight), weight.scales.float()
    inputs, out = q.shape
    count = s.shape[0]
    if weight.g_idx is None:  # contiguous groups: a broadcast, no gathered zeros or scales
        grouped = (q.view(count, inputs // count, out) - z[:, None]).float() * s[:, None]
        return grouped.view(inputs, out).t().to(dtype)
    parts = weight.g_idx.shape[0]
    width = out // parts
    pieces = []
    for part, g_idx in enumerate(weight.g_idx.long()):  # [in] each
        cols = slice(part * width, (part + 1) * width)
        pieces.append((q[:, cols] - z[g_idx, cols]).float() * s[g_idx, cols])
    return torch.cat(pieces, dim=1).t().to(dtype)


def _dequantize_rows(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize` of a format held `(out, in)`: codes `[out, in]`, zeros and scales `[out, groups]`."""
    q, z, s = codes(weight), zeros(weight), weight.scales.float()
    out, inputs = q.shape
    count = s.shape[1]
    if weight.g_idx is None:
        grouped = (q.view(out, count, inputs // count) - z[:, :, None]).float() * s[:, :, None]
        return grouped.view(out, inputs).to(dtype)
    height = out // weight.g_idx.shape[0]
    pieces = []
    for part, g_idx in enumerate(weight.g_idx.long()):  # [in] each
        rows = slice(part * height, (part + 1) * height)
        pieces.append((q[rows] - z[rows][:, g_idx]).float() * s[rows][:, g_idx])
    return torch.cat(pieces, dim=0).to(dtype)


def linear(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """`x @ W.T` for an int4 weight, whatever the family's own orientation.

    Half-precision elementwise ops are slow on CPU: there the product is taken in float32."""
    work = torch.float32 if x.device.type == "cpu" else x.dtype
    return F.linear(x.to(work), dequantize(weight, work)).to(x.dtype)


Q4_0_BLOCK = 32  # weights per ggml Q4_0 block: a float16 scale, then 16 bytes of codes


def to_q4_0(weight: Int4Weight) -> torch.Tensor | None:
    """The weight as ggml Q4_0 rows, uint8 `[out, in/32 · 18]`, holding the very same numbers, or
    None where Q4_0 cannot: a Q4_0 block is `d · (q − 8)`, so a symmetric weight (every zero point
    8) whose groups are whole blocks in order (no act-order) and whose scales float16 holds maps
    onto it code for code, its group's scale the scale of each of its blocks. Byte j of a block
    holds code j in its low nibble and code j + 16 in its high one, as ggml packs them."""
    if weight.g_idx is not None:
        return None
    q, z, s = codes(weight), zeros(weight), weight.scales
    if weight.format not in ROW_MAJOR:  # held [in, out]: to the weight's own (out, in)
        q, z, s = q.t(), z.t(), s.t()
    out, inputs = q.shape
    size = inputs // s.shape[1]  # inputs a group
    scale = s.to(torch.float16)
    if size % Q4_0_BLOCK or not bool((z == 8).all()) or not torch.equal(scale.to(s.dtype), s):
        return None
    blocks = inputs // Q4_0_BLOCK
    rows = torch.empty(out, blocks, 2 + Q4_0_BLOCK // 2, dtype=torch.uint8)
    per_block = scale.repeat_interleave(size // Q4_0_BLOCK, dim=1).contiguous()  # [out, blocks]
    rows[..., :2] = per_block.view(torch.uint8).view(out, blocks, 2)
    codes32 = q.reshape(out, blocks, Q4_0_BLOCK).to(torch.uint8)
    rows[..., 2:] = codes32[..., : Q4_0_BLOCK // 2] | (codes32[..., Q4_0_BLOCK // 2 :] << 4)
    return rows.view(out, -1)
