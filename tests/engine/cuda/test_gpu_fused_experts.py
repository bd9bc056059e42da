"""One-token steps through the fused expert kernels' cubins on a GPU (`engine.moe.fused_experts`):
a tiny Q4_K/Q6_K GGUF model the GPU holds whole gives the torch path's logits and transformers'
greedy tokens, with two kernel launches a MoE layer, no host read and no synchronisation a step;
bfloat16 goes through its own cubins, rounded once; CUDA graphs capture the launches.
The same steps run in Triton's interpreter on the CPU: tests/engine/gpu/test_fused_experts_model.py.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import AutoModelForCausalLM

from engine.bench.op_counts import HOST_READS, _value_reads, count_ops
from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.gpu.launch_ranges import RANGE_PREFIX
from engine.loader import load_model
from engine.moe.cuda_graphs import ExpertGraphs
from engine.moe.fused_experts import FusedExperts
from engine.prompts import greedy
from engine.tiny.gguf_writer import gguf_config, write_tiny_gguf
from tests.engine.exactness import assert_matches_reference

pytestmark = pytest.mark.gpu

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64]
STEPS = [5, 9, 13, 2]
RTOL = 1e-5  # of the logits' scale


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_tiny_gguf(
        tmp_path_factory.mktemp("fused"), expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q8_0
    )


def whole(path, dtype: str = "float32", fused: bool | None = None):
    """`path` with every expert on the GPU (filled at load: slot tables), fused as asked."""
    config = OffloadConfig(device="cuda", dtype=dtype, expert_budget=ExpertBudget.parse("all"))
    model = load_model(path, config)
    model.control.fused = fused
    return model


def experts_of(model) -> list:
    return [layer.mlp.experts for layer in model.hf_model.model.layers]


def decode_logits(model) -> torch.Tensor:
    kv = model.new_kv_cache()
    model.forward(torch.tensor(PROMPT), kv, logits_to_keep=1)
    return torch.cat([model.forward(torch.tensor([token]), kv) for token in STEPS])


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    error, scale = (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()
    assert error <= rtol * scale, f"max |Δ| {error:.3g} > {rtol:g} · max |ref| {scale:.3g}"


def test_decode_steps_run_the_cubins_and_give_the_torch_path_s_logits_and_tokens(gguf_path) -> None:
    fused, in_torch = whole(gguf_path), whole(gguf_path, fused=False)
    try:
        assert fused.cache.holds_all
        assert_close(decode_logits(fused), decode_logits(in_torch), RTOL)
        assert all(isinstance(experts.fused, FusedExperts) for experts in experts_of(fused))
        assert all(type(e.fused.kernels).__name__ == "_Cubins" for e in experts_of(fused))
        assert all(experts.fused is None for experts in experts_of(in_torch))
        config = greedy(16)
        tokens = generate_text(fused, PROMPT, config).token_ids
        assert tokens == generate_text(in_torch, PROMPT, config).token_ids
        reference = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, config=gguf_config(gguf_path), dtype=torch.float32
        )
        assert_matches_reference(fused, reference.to(fused.device).eval(), PROMPT)
    finally:
        fused.close()
        in_torch.close()


def test_a_step_launches_two_kernels_a_layer_and_never_waits_for_the_gpu(gguf_path) -> None:
    model = whole(gguf_path)
    try:
        kv = model.new_kv_cache()
        model.forward(torch.tensor(PROMPT), kv, logits_to_keep=1)
        model.forward(torch.tensor([5]), kv)  # each layer's first one-token step decides
        with torch.profiler.profile() as prof, _value_reads() as reads:
            model.forward(torch.tensor([9], device=model.device), kv)
        events = prof.events()
        assert not sum(reads.values()) and not [e.name for e in events if e.name in HOST_READS]
        assert not [e.name for e in events if e.name.endswith("Synchronize")]
        launches = sum(e.name.startswith(RANGE_PREFIX) for e in events)
        assert launches == 2 * len(model.store.layer_indices)
        counts = count_ops(model, PROMPT, 4)
        assert counts["kernels"] == 2 * len(model.store.layer_indices) and counts["host_syncs"] == 1
    finally:
        model.close()


def test_bfloat16_runs_its_own_cubins_and_rounds_the_float32_sums_once(gguf_path) -> None:
    model, in_torch = whole(gguf_path, "bfloat16"), whole(gguf_path, "bfloat16", fused=False)
    try:
        assert_close(decode_logits(model), decode_logits(in_torch), 3e-2)  # bfloat16's rounding apart
        experts = experts_of(model)[0]
        table = model.cache.slot_table(experts.layer)
        generator = torch.Generator().manual_seed(0)
        width = model.hf_model.config.hidden_size
        hidden = torch.randn(1, width, generator=generator).to(model.device, torch.bfloat16)
        index = torch.tensor([[2, 7]], device=model.device)
        weights = torch.tensor([[0.6, 0.4]], device=model.device, dtype=torch.bfloat16)
        got = experts.fused(hidden, index, weights, table)
        want = experts.fused(hidden.float(), index, weights.float(), table)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
        hidden, weights = hidden.half(), weights.half()
        half = experts.fused(hidden, index, weights, table)  # through float32 and back
        want = experts.fused(hidden.float(), index, weights.float(), table)
        assert half.dtype == torch.float16 and torch.equal(half, want.half())
    finally:
        model.close()
        in_torch.close()


def test_expert_cuda_graphs_replay_the_fused_launches(gguf_path) -> None:
    model = whole(gguf_path)
    try:
        eager = decode_logits(model)
        model.control.graphs = graphs = ExpertGraphs()
        assert torch.equal(decode_logits(model), eager)  # the same kernels on the same inputs
        assert graphs.off_because is None and graphs.captures == len(model.store.layer_indices)
    finally:
        model.close()
