"""engine.resident.device_blocks: a GGUF's matrices kept in their blocks (as on a GPU), loaded on the
CPU here (`BLOCKS_ON` widened): which linears are kept, and the model's outputs unchanged — a
prefill and the steps through the blocks dequantized per call equal the dequantized model's. The
one-row GEMV runs in Triton's interpreter in tests/engine/gpu/test_device_blocks_gemv.py."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from torch import nn

from engine.config import ExpertBudget, OffloadConfig
from engine.formats.gguf.blocks import dequantize
from engine.loader import load_model
from engine.resident import weights
from engine.resident.device_blocks import BlocksLinear
from engine.tiny.gguf_writer import write_tiny_gguf

PROMPT = torch.tensor([3, 17, 42, 99, 7, 250])


def _load(path, monkeypatch, blocks: bool):
    monkeypatch.setattr(weights, "BLOCKS_ON", ("cuda", "cpu") if blocks else ("cuda",))
    config = OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"))
    return load_model(path, config)


def _steps(model) -> list[torch.Tensor]:
    cache = model.new_kv_cache()
    logits = [model.forward(PROMPT, cache, logits_to_keep=0)]
    for token in (5, 9, 13):
        logits.append(model.forward(torch.tensor([token]), cache))
    return logits


@pytest.mark.parametrize("other_type", [QT.Q8_0, QT.Q4_K])
def test_kept_blocks_compute_what_the_dequantized_model_does(tmp_path, monkeypatch, other_type):
    path = write_tiny_gguf(tmp_path, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=other_type)
    kept, plain = _load(path, monkeypatch, True), _load(path, monkeypatch, False)
    try:
        linears = {n: m for n, m in kept.hf_model.named_modules() if isinstance(m, BlocksLinear)}
        attention = [n for n in linears if ".self_attn." in n]
        assert attention and all(m.ggml_type == other_type for m in linears.values())
        assert not any(".mlp.gate" in n for n in linears)  # the float router stays as it is
        assert not any(isinstance(m, BlocksLinear) for m in plain.hf_model.modules())
        for got, want in zip(_steps(kept), _steps(plain), strict=True):
            assert torch.equal(got, want)  # the same dequantized weights, the same F.linear
    finally:
        kept.close()
        plain.close()


def test_a_gemv_that_cannot_run_dequantizes(tmp_path):
    """On the CPU the cubin GEMV does not apply: one row goes through the dequantized blocks too."""
    linear = nn.Linear(64, 8, bias=True)
    blocks = BlocksLinear(linear, int(QT.Q8_0), 68)
    blocks.blocks = torch.randint(0, 256, (8, 68), dtype=torch.uint8)
    blocks.blocks.view(8, 2, 34)[..., :2] = torch.tensor([0, 60], dtype=torch.uint8)  # finite scales
    x = torch.randn(1, 64)
    weight = dequantize(blocks.blocks, QT.Q8_0, (8, 64), torch.float32)
    want = torch.nn.functional.linear(x, weight, linear.bias)
    assert torch.equal(blocks(x), want)
