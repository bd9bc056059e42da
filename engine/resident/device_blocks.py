"""A GGUF's quantized resident matrices kept in their blocks on a GPU (`BlocksLinear`).

Dequantized to bfloat16 a Q4_K_M file's attention projections and output head take ~3.5× their
bytes of device memory, and a decode step reads all of them: at Qwen3-30B-A3B's shapes ~2.4 GB a
token in bfloat16 against ~0.7 GB in the file's blocks. `keep_linears_on_device` replaces, in a
model built on the meta device, every `nn.Linear` whose weight the file stores in a block type the
fused GEMV reads (`engine.gpu.registry.KQUANT_TYPES`) by a `BlocksLinear` holding those blocks;
`fill_blocks` copies them onto the device once the model is allocated. A head tied to the
embedding, float matrices (the router) and other block types stay as they are.

`BlocksLinear.forward`: one row (a decode step) through the fused quantized GEMV
(`engine.gpu.kquant_moe.quantized_gemv_kernel`: each weight dequantized as `gguf.blocks.dequantize`
does, float32 sums, rounded once to the input's dtype); on CUDA its cubin through the driver, on the
CPU only when asked (`gemv = "interpreted"`: Triton's JIT in its interpreter, tests). More rows (a
prefill, a verification) and a GEMV that cannot run here: the blocks dequantized on the device in
the input's dtype and `F.linear`, as the dequantized model computes (a cubin that does not load is
logged once).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from engine.formats.gguf.blocks import dequantize
from engine.gpu.launch_ranges import launch_range
from engine.gpu.registry import FIELD_ALIGN, KQUANT_BLOCK_N, KQUANT_TYPES, kquant_name
from engine.resident.ggml_linear import quantized_linears

log = logging.getLogger(__name__)

GEMV_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # the cubins' activations
INTERPRETED_BLOCK_N = 512  # rows a program in Triton's interpreter


class BlocksLinear(nn.Module):
    """`nn.Linear` over a `[out, row bytes]` table of ggml blocks on the model's device."""

    def __init__(self, linear: nn.Linear, ggml_type: int, row_bytes: int, gemv: str = "cubin"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.ggml_type = ggml_type
        self.register_buffer(
            "blocks", torch.empty((self.out_features, row_bytes), dtype=torch.uint8), persistent=False
        )
        self.bias = linear.bias  # a parameter under the same name: loaded from the file as before
        self.gemv = gemv  # "cubin", "interpreted" (tests) or "off"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        y = self._gemv(x) if rows == 1 and x.dtype in GEMV_DTYPES else None
        if y is None:
            weight = dequantize(self.blocks, self.ggml_type, (self.out_features, self.in_features), x.dtype)
            y = F.linear(x, weight)
        return y if self.bias is None else y + self.bias

    def _gemv(self, x: torch.Tensor) -> torch.Tensor | None:
        """`W @ x` of one row through the fused GEMV, in x's dtype and shape; None where it cannot run."""
        if self.gemv == "off" or x.device != self.blocks.device:
            return None
        if self.gemv == "cubin" and x.device.type != "cuda":
            return None
        if not x.is_contiguous() or x.data_ptr() % FIELD_ALIGN:
            x = x.clone(memory_format=torch.contiguous_format)
        out = torch.empty(self.out_features, dtype=torch.float32, device=x.device)
        grid = (-(-self.out_features // KQUANT_BLOCK_N),)
        args = (x, self.blocks, out, self.out_features, self.in_features)
        name = kquant_name("quantized_gemv", self.ggml_type, GEMV_DTYPES[x.dtype])
        if self.gemv == "interpreted":  # the interpreter's time goes by programs: more rows each
            from engine.gpu import kquant_moe

            with launch_range(name):
                kquant_moe.quantized_gemv_kernel[(-(-self.out_features // INTERPRETED_BLOCK_N),)](
                    *args, GGML_TYPE=self.ggml_type, BLOCK_N=INTERPRETED_BLOCK_N, **kquant_moe.LAUNCH
                )
        else:
            kernel = _cubin(name, x.device.index or 0)
            if kernel is None:
                self.gemv = "off"
                return None
            kernel(grid, *args)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        name = GGMLQuantizationType(self.ggml_type).name
        return f"{self.in_features}, {self.out_features}, {name} blocks, bias={self.bias is not None}"


@functools.cache
def _cubin(name: str, device: int):
    """The cubin `name` on `device`, once; None (logged once) where it does not load."""
    from engine.gpu.launcher import CubinKernel

    try:
        return CubinKernel.load(name, device=device)
    except (RuntimeError, OSError, KeyError) as err:
        log.warning("The quantized GEMV %s does not load (%s): its matrices dequantize per call", name, err)
        return None


def keep_linears_on_device(hf_model: nn.Module, checkpoint, gemv: str = "cubin") -> dict[str, object]:
    """Put a `BlocksLinear` in `hf_model` (on the meta device) for each linear layer whose weight the
    GGUF `checkpoint` stores in a block type the fused GEMV reads; {the weight name it replaces
    (not to be loaded): the file's reader tensor}."""
    kept = {}
    for parent, name, child, weight_name, tensor in quantized_linears(hf_model, checkpoint):
        if int(tensor.tensor_type) not in KQUANT_TYPES:
            continue
        with torch.device("meta"):
            linear = BlocksLinear(child, int(tensor.tensor_type), int(tensor.data.shape[-1]), gemv)
        setattr(parent, name, linear)
        kept[weight_name] = tensor
    return kept


def fill_blocks(hf_model: nn.Module, kept: dict[str, object], device: torch.device) -> None:
    """Each kept weight's blocks copied out of the file's memory map onto `device`."""
    modules = dict(hf_model.named_modules())
    for weight_name, tensor in kept.items():
        module = modules[weight_name.removesuffix(".weight")]
        blocks = torch.from_numpy(np.array(tensor.data)).reshape(module.blocks.shape)
        module.blocks = blocks.to(device)
