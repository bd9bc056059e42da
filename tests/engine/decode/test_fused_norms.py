"""RMS norms switched to `F.rms_norm` (`engine.decode.fused_norms`) only where they compute the same:
every tiny family's logits unchanged bit for bit, other norms kept."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from engine.decode.fused_norms import fuse_rms_norms
from engine.tiny.models import TINY_ARCHITECTURES, build_tiny_model

KEPT = {"gpt_oss": "its weight multiplies before the downcast", "phimoe": "LayerNorm, not RMSNorm"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_fused_norms_leave_every_familys_logits_bit_for_bit(model_type, dtype) -> None:
    model = build_tiny_model(model_type, seed=1).to(dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    fused = fuse_rms_norms(model)
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(got, expected)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    if model_type in KEPT:
        assert fused == 0, KEPT[model_type]
    else:
        assert fused == len(norms) > 0
        assert all(isinstance(m.forward, functools.partial) for m in norms)


class OnePlusWeightRMSNorm(nn.Module):  # Gemma's
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = hidden.float() * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(hidden.dtype)


class GatedRMSNorm(nn.Module):  # a second input (Qwen3-Next's linear attention); Llama's without it
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        h = hidden.float()
        out = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(
            hidden.dtype
        )
        return out if gate is None else out * gate


def test_norms_that_compute_otherwise_keep_their_own_forward() -> None:
    model = nn.Sequential(OnePlusWeightRMSNorm(16), GatedRMSNorm(16))
    assert fuse_rms_norms(model) == 0
    assert all(not isinstance(m.forward, functools.partial) for m in model)
