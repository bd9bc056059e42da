"""A GGUF's resident matrices kept in their blocks and computed by ggml's kernels (`--kernels ggml`).

With `--kernels ggml` on the CPU the routed experts already go through llama.cpp's kernels
(engine.ggml.kernels); the attention projections, shared experts and output head are the
rest of each token's work. Dequantized to bfloat16 they take 3.5× a Q4_K file's bytes of RAM and
go through torch's bfloat16 matmul, which on a CPU without bfloat16 instructions is slower than
llama.cpp's 4-bit one. `keep_linears_quantized` replaces, in a model built on the meta device,
every `nn.Linear` whose weight the file stores quantized by a `GgmlLinear` holding those blocks
(its bias stays a parameter, loaded as before); `fill_linears` copies the blocks in once the model
is allocated. Float matrices (the F32 router, 1-D norms) and a head tied to the embedding stay as
they are.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from engine.formats.gguf.repack import GGML_FLOATS
from engine.ggml import interleave as ggml_interleave
from engine.ggml import kernels as ggml_kernels


class GgmlLinear(nn.Module):
    """`nn.Linear` over a `[out, row bytes]` table of ggml blocks (non-persistent buffer)."""

    def __init__(self, linear: nn.Linear, ggml_type: int, row_bytes: int):
        super().__init__()
        self.in_features, self.out_features, self.ggml_type = (
            linear.in_features,
            linear.out_features,
            ggml_type,
        )
        self.register_buffer(
            "blocks", torch.empty((self.out_features, row_bytes), dtype=torch.uint8), persistent=False
        )
        self.bias = linear.bias  # a parameter under the same name: loaded from the file as before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ggml_kernels.linear(x, self.blocks, self.ggml_type, self.out_features, self.in_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"{self.in_features}, {self.out_features}, ggml type {self.ggml_type}, bias={bias}"


def keep_linears_quantized(hf_model: nn.Module, checkpoint) -> dict[str, object]:
    """Put a `GgmlLinear` in `hf_model` (on the meta device) for each linear layer whose weight the
    GGUF `checkpoint` stores quantized; {the weight name it replaces (not to be loaded): the file's
    reader tensor}."""
    kept = {}
    for parent, name, child, weight_name, tensor in quantized_linears(hf_model, checkpoint, GGML_FLOATS):
        with torch.device("meta"):
            setattr(parent, name, GgmlLinear(child, int(tensor.tensor_type), int(tensor.data.shape[-1])))
        kept[weight_name] = tensor
    return kept


def quantized_linears(hf_model: nn.Module, checkpoint, also: frozenset = frozenset()):
    """`(parent, attribute, linear, weight name, the file's reader tensor)` of each `nn.Linear` of
    `hf_model` whose weight the GGUF `checkpoint` stores as rows of quantized blocks (or of a float
    type in `also`); a head tied to the embedding left out."""
    tied = hf_model.config.get_text_config().tie_word_embeddings
    head = hf_model.get_output_embeddings()
    for parent_name, parent in list(hf_model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or (tied and child is head):
                continue
            weight_name = f"{parent_name}.{name}.weight".lstrip(".")
            tensor = checkpoint.quantized_tensor(weight_name, also=also)
            if tensor is not None and tensor.data.shape[0] == child.out_features:
                yield parent, name, child, weight_name, tensor


def fill_linears(hf_model: nn.Module, kept: dict[str, object]) -> None:
    """Copy each kept weight's blocks out of the file's memory map into its `GgmlLinear`: into
    llama.cpp's interleaved rows where ggml has them for the type on this CPU (engine.ggml.interleave,
    as llama.cpp's CPU_REPACK buffers hold the same weights), else as they are."""
    modules = dict(hf_model.named_modules())
    with torch.no_grad():
        for weight_name, tensor in kept.items():
            module = modules[weight_name.removesuffix(".weight")]
            blocks = torch.from_numpy(np.array(tensor.data)).reshape(module.blocks.shape)
            if not ggml_interleave.interleaves(module.ggml_type, module.out_features):
                module.blocks.copy_(blocks)
                continue
            rows = ggml_interleave.allocate(blocks.numel(), weight_name).view(blocks.shape)
            ggml_interleave.interleave_into(
                rows, blocks, module.ggml_type, module.out_features, module.in_features
            )
            module.blocks = rows
