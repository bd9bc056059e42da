"""A tiny Q4_K/Q6_K GGUF model's one-token steps through the fused expert kernels
(`engine.moe.fused_experts`), run by Triton's interpreter on the CPU with CUDA's layout emulated (the
file's blocks as stored, a slot for every expert, the slot tables): the torch path's logits and
greedy tokens, nothing read on the host, two kernel launches a MoE layer, each layer's choice made
once; and a Q5_K/Q6_K one's logits. Interpreted in a child process (tests/engine/gpu/interpreter.py
says why).
"""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.bench.op_counts import HOST_READS, _inside_kernel, _value_reads, count_ops
from engine.generation import generate_text
from engine.gpu.launch_ranges import RANGE_PREFIX
from engine.moe.cuda_graphs import ExpertGraphs
from engine.moe.fused_experts import FusedExperts
from engine.prompts import greedy
from engine.tiny.gguf_writer import write_tiny_gguf
from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter
from tests.engine.moe.test_cuda_graphs import stand_in_capture
from tests.engine.moe.test_fused_experts import experts_of, load_emulating_cuda

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

PROMPT = [3, 17, 42, 99, 7, 250]
STEPS = [5, 9, 13, 2]  # decode steps' tokens
RTOL = 1e-5  # of the logits' scale: the kernels sum in another order than BLAS (~5e-7 here)


def test_the_fused_experts_in_a_child_interpreter() -> None:
    """This module's tests, run by pytest in a process with TRITON_INTERPRET=1 from its start."""
    run_in_child_interpreter(__file__)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("fused"), expert_type=QT.Q4_K, down_type=QT.Q6_K)


@contextlib.contextmanager
def fused_and_torch(path: Path, monkeypatch, load=load_emulating_cuda):
    """The same file twice, `load(path, monkeypatch)` (CUDA's layout emulated, every expert in a
    slot): (fused kernels forced on, the torch path)."""
    fused, in_torch = (load(path, monkeypatch) for _ in range(2))
    fused.control.fused, in_torch.control.fused = True, False
    try:
        yield fused, in_torch
    finally:
        fused.close()
        in_torch.close()


@pytest.fixture
def models(gguf_path, monkeypatch):
    with fused_and_torch(gguf_path, monkeypatch) as pair:
        yield pair


def decode_logits(model) -> torch.Tensor:
    """The prompt's prefill, then one-token steps: their logits `[len(STEPS), V]`."""
    kv = model.new_kv_cache()
    model.forward(torch.tensor(PROMPT), kv, logits_to_keep=1)
    return torch.cat([model.forward(torch.tensor([token]), kv) for token in STEPS])


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    error, scale = (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()
    assert error <= rtol * scale, f"max |Δ| {error:.3g} > {rtol:g} · max |ref| {scale:.3g}"


@in_the_interpreter
def test_decode_steps_give_the_torch_path_s_logits_and_greedy_tokens(models, monkeypatch) -> None:
    fused, in_torch = models
    decisions = []
    real_of = FusedExperts.of.__func__
    monkeypatch.setattr(
        FusedExperts, "of", classmethod(lambda cls, m: decisions.append(m.layer) or real_of(cls, m))
    )
    assert_close(decode_logits(fused), decode_logits(in_torch))
    assert all(isinstance(experts.fused, FusedExperts) for experts in experts_of(fused))
    assert all(experts.fused is None for experts in experts_of(in_torch))
    config = greedy(8)
    assert generate_text(fused, PROMPT, config).token_ids == generate_text(in_torch, PROMPT, config).token_ids
    layers = sorted(fused.store.layer_indices)
    assert sorted(decisions) == sorted(layers * 2)  # each layer of each model decided once, over every step


@in_the_interpreter
def test_a_decode_step_reads_nothing_on_the_host_and_launches_two_kernels_a_layer(models) -> None:
    fused, _ = models
    kv = fused.new_kv_cache()
    fused.forward(torch.tensor(PROMPT), kv, logits_to_keep=1)
    fused.forward(torch.tensor([5]), kv)  # each layer's first one-token step decides (a CPU probe)
    with torch.profiler.profile() as prof, _value_reads() as reads:
        fused.forward(torch.tensor([9]), kv)
    events = prof.events()
    assert not sum(reads.values()) and not [e.name for e in events if e.name in HOST_READS]
    launches = [e.name for e in events if e.name.startswith(RANGE_PREFIX)]
    layers = len(fused.store.layer_indices)
    assert sorted(launches) == sorted(
        [f"{RANGE_PREFIX}moe_gate_up_q4_k", f"{RANGE_PREFIX}moe_down_q6_k"] * layers
    )


@in_the_interpreter
def test_a_layer_s_experts_are_one_allocation_and_two_launches(models) -> None:
    """Beside its two kernels a fused call dispatches one operator, its output's allocation."""
    fused, _ = models
    experts = experts_of(fused)[0]
    table = fused.cache.slot_table(experts.layer)
    hidden, index, weights = torch.randn(1, 256), torch.tensor([[6, 1]]), torch.tensor([[0.7, 0.3]])
    experts.fused(hidden, index, weights, table)  # the buffer between the kernels, allocated once
    with torch.profiler.profile() as prof:
        experts.fused(hidden, index, weights, table)
    events = [e for e in prof.events() if not _inside_kernel(e)]
    assert [e.name for e in events if e.name.startswith("aten::")] == ["aten::empty"]
    assert sum(e.name.startswith(RANGE_PREFIX) for e in events) == 2


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_hidden_states_come_back_in_their_dtype(models, dtype) -> None:
    """bfloat16 goes to the kernels as it is, float16 through float32 (as on CUDA, whose kernels are
    built for float32 and bfloat16): the float32 sums of the rounded inputs, rounded once — to
    nearest on a GPU (tests/engine/cuda checks it bit for bit), while Triton's interpreter truncates
    a float32 it stores into bfloat16 (within one step of bfloat16's 8 bits here)."""
    fused, _ = models
    experts = experts_of(fused)[1]
    table = fused.cache.slot_table(experts.layer)
    hidden, index = torch.randn(1, 256, generator=torch.Generator().manual_seed(0)), torch.tensor([[2, 7]])
    weights = torch.tensor([[0.6, 0.4]])
    want = experts.fused(hidden.to(dtype).float(), index, weights.to(dtype).float(), table)
    got = experts.fused(hidden.to(dtype), index, weights.to(dtype), table)
    assert got.dtype == dtype and got.shape == (1, 256)
    if dtype == torch.float16:
        assert torch.equal(got, want.to(dtype))  # the same float32 sums, rounded once
    else:
        assert ((got.float() - want).abs() <= want.abs() * 2.0**-7).all()


@in_the_interpreter
def test_expert_graphs_capture_the_fused_kernels(models) -> None:
    """`ExpertGraphs` captures whatever `forward_resident` does: here the two kernels a layer."""
    fused, _ = models
    eager = decode_logits(fused)
    fused.control.graphs = graphs = ExpertGraphs(capture=stand_in_capture)
    assert torch.equal(decode_logits(fused), eager)
    assert graphs.captures == len(fused.store.layer_indices) and graphs.off_because is None


@in_the_interpreter
def test_count_ops_counts_the_fused_launches_and_no_host_read_but_the_token(models) -> None:
    fused, _ = models
    counts = count_ops(fused, PROMPT, 3)
    assert counts["kernels"] == 2 * len(fused.store.layer_indices)
    assert counts["host_syncs"] == 1  # the sampled token


@in_the_interpreter
def test_q5_k_experts_give_the_torch_path_s_logits(tmp_path, monkeypatch) -> None:
    """Q5_K gate and up, Q6_K down (a Q5_K_M file's experts): each layer's fused kernels read them."""
    path = write_tiny_gguf(tmp_path, expert_type=QT.Q5_K, down_type=QT.Q6_K)
    with fused_and_torch(path, monkeypatch) as (fused, in_torch):
        assert_close(decode_logits(fused), decode_logits(in_torch))
        chosen = [experts.fused for experts in experts_of(fused)]
        assert all(isinstance(c, FusedExperts) and c.gate_up.ggml_type == QT.Q5_K for c in chosen)


def load_with_a_budget(path: Path, monkeypatch, slots: int):
    """`path` as CUDA holds it with `slots` device slots (fewer than the experts: the cache misses
    and evicts), experts computed in groups."""
    from engine.config import ExpertBudget, OffloadConfig
    from engine.formats.gguf.experts import GgufFormat
    from engine.loader import load_model

    monkeypatch.setattr(GgufFormat, "repacks_for_cpu", False)
    budget = ExpertBudget.parse(str(slots))
    model = load_model(
        path, OffloadConfig(device="cpu", dtype="float32", expert_budget=budget, sim_link_gbps=50.0)
    )
    model.control.grouped = True
    return model


@in_the_interpreter
def test_with_a_budget_one_token_steps_compute_their_slots_through_the_fused_kernels(gguf_path, monkeypatch):
    """A cache that misses: each one-token step's routes are read, the misses brought into slots,
    and the K experts computed by the two kernels over a table of their slots — the torch path's
    logits and greedy tokens, the same hits and misses."""
    with fused_and_torch(gguf_path, monkeypatch, eight_slots) as (fused, in_torch):
        assert fused.cache.n_slots < fused.store.total_experts
        with profiled_launches() as launches:
            got = decode_logits(fused)
        assert_close(got, decode_logits(in_torch))
        layers = len(fused.store.layer_indices)
        # every decode step's layers (none streams at this budget), and the prefill's last layer,
        # which computes its one kept row alone
        assert launches.count(f"{RANGE_PREFIX}moe_gate_up_q4_k") == layers * len(STEPS) + 1
        stats = [model.cache.stats.total() for model in (fused, in_torch)]
        assert (stats[0].hits, stats[0].misses) == (stats[1].hits, stats[1].misses) and stats[0].misses > 0
        assert same_greedy_tokens(fused, in_torch, PROMPT)


def eight_slots(path: Path, monkeypatch):
    """`load_with_a_budget`'s model with 8 slots (the tiny files have 16 or more experts)."""
    return load_with_a_budget(path, monkeypatch, 8)


def same_greedy_tokens(model, other, prompt: list[int]) -> bool:
    """Whether both models reply to `prompt` with the same 8 greedy tokens."""
    return (
        generate_text(model, prompt, greedy(8)).token_ids == generate_text(other, prompt, greedy(8)).token_ids
    )


@contextlib.contextmanager
def profiled_launches():
    """The names of the engine's kernel launches while the block runs."""
    names: list[str] = []
    with torch.profiler.profile() as prof:
        yield names
    names.extend(e.name for e in prof.events() if e.name.startswith(RANGE_PREFIX))
