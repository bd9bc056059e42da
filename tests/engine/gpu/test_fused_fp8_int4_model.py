"""Tiny FP8 and int4 checkpoints' one-token steps through the fused expert kernels
(`engine.moe.fused_experts` → `engine.gpu.fp8_moe`, `engine.gpu.int4_moe`), run by Triton's
interpreter on the CPU with CUDA's layout emulated (a slot for every expert, the slot tables): the
torch path's logits and greedy tokens, and two launches a MoE layer of the checkpoint's own family.
The folders are written as the format tests write them (published configs and packers). Interpreted
in a child process (tests/engine/gpu/interpreter.py says why).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.generation import generate_text
from engine.gpu.launch_ranges import RANGE_PREFIX
from engine.moe.fused_experts import FusedExperts
from engine.prompts import greedy
from tests.engine.formats.test_fp8 import write_fp8_model
from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter
from tests.engine.moe.test_fused_experts import experts_of, load_emulating_cuda
from tests.engine.store.test_from_compressed_tensors import write_model as write_compressed_model
from tests.engine.store.test_gptq_awq import write_int4_model

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

PROMPT = [3, 17, 42, 99, 7, 250]
STEPS = [5, 9, 13]  # decode steps' tokens
RTOL = 1e-5  # of the logits' scale: the kernels sum in another order than BLAS
# variant → (how its folder is written, the label of its kernels' launches)
VARIANTS = {
    "fp8-block-128": (lambda folder, ref: write_fp8_model(folder, ref), "fp8"),
    "fp8-per-tensor": (lambda folder, ref: write_fp8_model(folder, ref, per_tensor=True), "fp8"),
    "gptq": (lambda folder, ref: write_int4_model(folder, ref, "gptq"), "int4_gptq"),
    "gptq-act-order": (
        lambda folder, ref: write_int4_model(folder, ref, "gptq_act_order"),
        "int4_gptq_g_idx",
    ),
    "awq": (lambda folder, ref: write_int4_model(folder, ref, "awq"), "int4_awq"),
    "ct-sym": (lambda folder, ref: write_compressed_model(folder, ref, "w4a16"), "int4_ct_sym"),
    "ct-act-order": (
        lambda folder, ref: write_compressed_model(folder, ref, "w4a16_asym_actorder"),
        "int4_ct_g_idx",
    ),
}


def test_the_fused_experts_in_a_child_interpreter() -> None:
    """This module's tests, run by pytest in a process with TRITON_INTERPRET=1 from its start."""
    run_in_child_interpreter(__file__, timeout=600)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    """(a tiny qwen3_moe folder in the variant's published format, its launches' label)."""
    write, label = VARIANTS[request.param]
    folder = write(tmp_path_factory.mktemp(request.param), tmp_path_factory.mktemp("reference"))
    return folder, label


@pytest.fixture
def models(variant, monkeypatch):
    """The same folder twice, CUDA's layout emulated: (fused kernels forced on, the torch path)."""
    fused, in_torch = (load_emulating_cuda(variant[0], monkeypatch) for _ in range(2))
    fused.control.fused, in_torch.control.fused = True, False
    yield fused, in_torch
    fused.close()
    in_torch.close()


def decode_logits(model) -> torch.Tensor:
    """The prompt's prefill, then one-token steps: their logits `[len(STEPS), V]`."""
    kv = model.new_kv_cache()
    model.forward(torch.tensor(PROMPT), kv, logits_to_keep=1)
    return torch.cat([model.forward(torch.tensor([token]), kv) for token in STEPS])


@in_the_interpreter
def test_decode_steps_give_the_torch_path_s_logits_and_greedy_tokens(models, variant) -> None:
    fused, in_torch = models
    got, want = decode_logits(fused), decode_logits(in_torch)
    error, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert error <= RTOL * scale, f"max |Δ| {error:.3g} > {RTOL:g} · max |ref| {scale:.3g}"
    assert all(isinstance(experts.fused, FusedExperts) for experts in experts_of(fused))
    config = greedy(6)
    assert generate_text(fused, PROMPT, config).token_ids == generate_text(in_torch, PROMPT, config).token_ids


@in_the_interpreter
def test_a_decode_step_launches_its_family_s_two_kernels_a_layer(models, variant) -> None:
    fused, _ = models
    kv = fused.new_kv_cache()
    fused.forward(torch.tensor(PROMPT), kv, logits_to_keep=1)
    fused.forward(torch.tensor([5]), kv)  # each layer's first one-token step decides
    with torch.profiler.profile() as prof:
        fused.forward(torch.tensor([9]), kv)
    launches = [e.name for e in prof.events() if e.name.startswith(RANGE_PREFIX)]
    label, layers = variant[1], len(fused.store.layer_indices)
    assert sorted(launches) == sorted(
        [f"{RANGE_PREFIX}moe_gate_up_{label}", f"{RANGE_PREFIX}moe_down_{label}"] * layers
    )


@in_the_interpreter
def test_with_a_budget_their_one_token_steps_go_through_the_kernels_too(variant, monkeypatch):
    """A cache that misses: a one-token step's experts, brought into slots, go through the family's
    kernels (FP8 and int4 experts are never gathered in torch), with the torch path's logits."""
    from tests.engine.gpu.test_fused_experts_model import eight_slots, fused_and_torch, profiled_launches

    folder, label = variant
    with fused_and_torch(folder, monkeypatch, eight_slots) as (fused, in_torch):
        assert fused.cache.n_slots < fused.store.total_experts
        with profiled_launches() as launches:
            got = decode_logits(fused)
        want = decode_logits(in_torch)
        error, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert error <= RTOL * scale, f"max |Δ| {error:.3g} > {RTOL:g} · max |ref| {scale:.3g}"
        assert f"{RANGE_PREFIX}moe_gate_up_{label}" in launches and fused.cache.stats.total().misses > 0
