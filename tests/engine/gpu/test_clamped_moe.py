"""gpt-oss's experts through the fused kernels (`moe_gate_up_clamped`, `moe_down_biased` in
engine.gpu.kquant_moe), in Triton's interpreter on the CPU: against the reference — the MXFP4
blocks dequantized → F.linear + bias → gpt-oss's gate (interleaved gate and up, clamped) → down +
bias → Σ_k w_k · — to 1e-6 of the output, biases in float32 and bfloat16; and a tiny gpt-oss
checkpoint as OpenAI ships it (MXFP4 experts) decoding through them with CUDA's layout emulated:
the torch path's logits and greedy tokens. Interpreted in a child process
(tests/engine/gpu/interpreter.py says why)."""

import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from engine.formats.gguf.blocks import dequantize
from engine.gpu.checks.experts import random_blocks
from engine.moe.fused_experts import FusedExperts
from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter
from tests.engine.gpu.test_fused_experts_model import fused_and_torch, same_greedy_tokens
from tests.engine.moe.test_fused_experts import experts_of
from tests.engine.store.test_from_mxfp4 import write_mxfp4_model

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

HIDDEN, INTER, EXPERTS, SLOTS = 256, 128, 5, 7
IDS = [3, 0, 3, 1]  # top-k with a repeat
ALIGN, BLOCK_N = 64, 64
ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's config
RTOL = 1e-6


def test_the_kernels_in_a_child_interpreter():
    """This module's tests, run by pytest in a process with TRITON_INTERPRET=1 from its start."""
    run_in_child_interpreter(__file__)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class BiasedPool:
    """EXPERTS MXFP4 experts with their biases (gate_up, its bias, down, its bias, each at a 64-byte
    boundary) in shuffled rows of a uint8 pool; its slot table."""

    def __init__(self, rng: np.random.Generator, bias_dtype: torch.dtype):
        def normal(*shape):
            return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))

        self.gate_up = [random_blocks(QT.MXFP4, 2 * INTER, HIDDEN, rng) for _ in range(EXPERTS)]
        self.down = [random_blocks(QT.MXFP4, HIDDEN, INTER, rng) for _ in range(EXPERTS)]
        # biases large enough to push gates and ups past the limit (the clamps are exercised)
        self.up_bias = [(normal(2 * INTER) * 6).to(bias_dtype) for _ in range(EXPERTS)]
        self.down_bias = [normal(HIDDEN).to(bias_dtype) for _ in range(EXPERTS)]
        sizes = [self.gate_up[0].numel(), 2 * INTER * bias_dtype.itemsize, self.down[0].numel()]
        self.offsets = [0]
        for size in sizes:
            self.offsets.append(_aligned(self.offsets[-1] + size))
        nbytes = _aligned(self.offsets[-1] + HIDDEN * bias_dtype.itemsize)
        self.pool = torch.from_numpy(rng.integers(0, 256, (SLOTS, nbytes), dtype=np.uint8))
        slots = rng.permutation(SLOTS)[:EXPERTS]
        for expert, slot in enumerate(slots):
            fields = (self.gate_up[expert], self.up_bias[expert], self.down[expert], self.down_bias[expert])
            for offset, field in zip(self.offsets, fields, strict=True):
                data = (
                    field.reshape(-1).view(torch.uint8) if field.dtype != torch.uint8 else field.reshape(-1)
                )
                self.pool[slot, offset : offset + data.numel()] = data
        self.table = torch.tensor(slots)

    def act(self, kq, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
        act = torch.empty(len(ids), INTER)
        grid = (-(-INTER // BLOCK_N), len(ids))
        kq.moe_gate_up_clamped_kernel[grid](
            x, self.pool, self.table, torch.tensor(ids), act, self.pool.shape[1], self.offsets[0],
            self.offsets[1], INTER, HIDDEN, ALPHA, LIMIT,
            GGML_TYPE=int(QT.MXFP4), BLOCK_N=BLOCK_N, **kq.LAUNCH,
        )  # fmt: skip
        return act

    def out(self, kq, act: torch.Tensor, ids: list[int], weights: torch.Tensor) -> torch.Tensor:
        out = torch.empty(HIDDEN, dtype=weights.dtype)
        kq.moe_down_biased_kernel[(-(-HIDDEN // BLOCK_N),)](
            act, self.pool, self.table, torch.tensor(ids), weights, out, self.pool.shape[1],
            self.offsets[2], self.offsets[3], HIDDEN, INTER, len(ids), GGML_TYPE=int(QT.MXFP4),
            BLOCK_N=BLOCK_N, **kq.LAUNCH,
        )  # fmt: skip
        return out

    def reference_act(self, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
        acts = []
        for expert in ids:
            weight = dequantize(self.gate_up[expert], QT.MXFP4, (2 * INTER, HIDDEN), torch.float32)
            gate_up = F.linear(x.float(), weight) + self.up_bias[expert].float()
            gate, up = gate_up[::2].clamp(max=LIMIT), gate_up[1::2].clamp(-LIMIT, LIMIT)  # gpt-oss's
            acts.append((up + 1) * (gate * torch.sigmoid(gate * ALPHA)))
        return torch.stack(acts)

    def reference_out(self, act: torch.Tensor, ids: list[int], weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(HIDDEN)
        for k, expert in enumerate(ids):
            weight = dequantize(self.down[expert], QT.MXFP4, (HIDDEN, INTER), torch.float32)
            out += weights[k].float() * (F.linear(act[k], weight) + self.down_bias[expert].float())
        return out


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    error, scale = (got.float() - want).abs().max().item(), want.abs().max().item()
    assert error <= rtol * scale, f"max |Δ| {error:.3g} > {rtol:g} · max |ref| {scale:.3g}"


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_clamped_gate_and_biased_down_match_the_reference(dtype):
    from engine.gpu import kquant_moe as kq

    rng = np.random.default_rng(41)
    pool = BiasedPool(rng, dtype)
    x = torch.from_numpy(rng.standard_normal(HIDDEN).astype(np.float32)).to(dtype)
    act = pool.act(kq, x, IDS)
    want = pool.reference_act(x, IDS)
    assert (want.abs() > 0).all() and want.max() > LIMIT  # past the clamps, and none dead
    assert_close(act, want)
    weights = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=dtype)
    out = pool.out(kq, act, IDS, weights)
    want_out = pool.reference_out(want, IDS, weights)
    # bfloat16: the output is rounded once as it is stored
    assert_close(out, want_out, RTOL if dtype == torch.float32 else 2**-8)


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    return write_mxfp4_model(tmp_path_factory.mktemp("gpt-oss-mxfp4"))


@in_the_interpreter
def test_gpt_oss_decodes_through_them_as_through_torch(mxfp4_folder, monkeypatch):
    with fused_and_torch(mxfp4_folder, monkeypatch) as (fused, in_torch):
        prompt = [3, 17, 42, 99, 7]
        logits = []
        for model in (fused, in_torch):
            kv = model.new_kv_cache()
            model.forward(torch.tensor(prompt), kv, logits_to_keep=1)
            logits.append(torch.cat([model.forward(torch.tensor([t]), kv) for t in (5, 9, 13)]))
        assert_close(logits[0], logits[1], 1e-5)
        chosen = [experts.fused for experts in experts_of(fused)]
        assert all(isinstance(c, FusedExperts) and c.gate is not None for c in chosen)
        assert chosen[0].gate.limit == LIMIT and chosen[0].gate.alpha == pytest.approx(ALPHA)
        assert same_greedy_tokens(fused, in_torch, prompt)
