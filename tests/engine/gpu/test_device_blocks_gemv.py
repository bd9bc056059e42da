"""`BlocksLinear`'s one-row GEMV (engine.resident.device_blocks) in Triton's interpreter: the
dequantized model's outputs to float32 rounding, in the input's dtype and shape, with its bias;
and a tiny GGUF whose matrices stay in their blocks decoding the same greedy tokens through the
captured step. Interpreted in a child process (tests/engine/gpu/interpreter.py says why)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from torch import nn

from engine.formats.gguf.blocks import dequantize
from engine.gpu.checks.experts import random_blocks
from engine.resident.device_blocks import BlocksLinear
from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)


def test_the_gemv_in_a_child_interpreter() -> None:
    run_in_child_interpreter(__file__)


@in_the_interpreter
@pytest.mark.parametrize("ggml_type", [QT.Q4_K, QT.Q6_K, QT.Q8_0])
def test_one_row_goes_through_the_gemv(ggml_type) -> None:
    out_features, in_features = 20, 512  # a last block of rows part-filled
    linear = nn.Linear(in_features, out_features, bias=True)
    blocks = random_blocks(ggml_type, out_features, in_features, np.random.default_rng(0))
    module = BlocksLinear(linear, int(ggml_type), blocks.shape[1], gemv="interpreted")
    module.blocks = blocks
    weight = dequantize(blocks, ggml_type, (out_features, in_features), torch.float32)
    x = torch.randn(1, 1, in_features)
    with torch.no_grad():
        got, want = module(x), F.linear(x, weight, linear.bias)
    assert got.shape == (1, 1, out_features) and got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    module.gemv = "off"  # the same call through the dequantized blocks: another order of sums
    assert torch.allclose(module(x), got, rtol=0, atol=1e-6 * want.abs().max().item())
