"""One-token steps through the FP8 and int4 expert kernels' cubins on a GPU (`engine.moe.fused_experts`
→ `engine.gpu.fp8_moe`, `engine.gpu.int4_moe`), and gpt-oss's MXFP4 pair (`engine.gpu.kquant_moe`):
a tiny checkpoint of each published format the GPU holds whole gives the torch path's logits and
greedy tokens, two launches a MoE layer of its own family. The same steps run in Triton's
interpreter on the CPU: tests/engine/gpu/test_fused_fp8_int4_model.py, test_clamped_moe.py.

Every test needs a CUDA device (conftest skips them without one)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.loader import load_model
from engine.moe.fused_experts import FusedExperts
from engine.prompts import greedy
from tests.engine.formats.test_fp8 import write_fp8_model
from tests.engine.store.test_from_compressed_tensors import write_model as write_compressed_model
from tests.engine.store.test_from_mxfp4 import write_mxfp4_model
from tests.engine.store.test_gptq_awq import write_int4_model

pytestmark = pytest.mark.gpu

PROMPT = [3, 17, 42, 99, 7, 250]
STEPS = [5, 9, 13]
RTOL = 1e-5  # of the logits' scale: the kernels sum in another order than cuBLAS
# variant → (how its folder is written, the cubins its layers launch: moe_gate_up_<label>_fp32)
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
# gpt-oss as OpenAI ships it: MXFP4 experts with biases and its clamped gate, through their own pair
GPT_OSS = (
    lambda folder, ref: write_mxfp4_model(folder),
    ("moe_gate_up_clamped_mxfp4", "moe_down_biased_mxfp4"),
)


def _kernels(label) -> tuple[str, str]:
    """The cubins' stems a variant's layers launch (`label`: the family's, or the pair itself)."""
    return label if isinstance(label, tuple) else (f"moe_gate_up_{label}", f"moe_down_{label}")


def whole(path, fused: bool | None = None):
    """`path` with every expert on the GPU, fused as asked."""
    config = OffloadConfig(device="cuda", dtype="float32", expert_budget=ExpertBudget.parse("all"))
    model = load_model(path, config)
    model.control.fused = fused
    return model


def decode_logits(model) -> torch.Tensor:
    kv = model.new_kv_cache()
    model.forward(torch.tensor(PROMPT), kv, logits_to_keep=1)
    return torch.cat([model.forward(torch.tensor([token]), kv) for token in STEPS])


@pytest.mark.parametrize("variant", [*VARIANTS, "gpt-oss-mxfp4"])
def test_decode_steps_run_the_family_s_cubins_and_give_the_torch_path_s_logits(variant, tmp_path):
    write, label = VARIANTS.get(variant, GPT_OSS)
    folder = write(tmp_path / "model", tmp_path / "reference")
    fused, in_torch = whole(folder), whole(folder, fused=False)
    try:
        got, want = decode_logits(fused), decode_logits(in_torch)
        error, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert error <= RTOL * scale, f"max |Δ| {error:.3g} > {RTOL:g} · max |ref| {scale:.3g}"
        experts = [layer.mlp.experts for layer in fused.hf_model.model.layers]
        assert all(isinstance(e.fused, FusedExperts) for e in experts)
        assert all(type(e.fused.kernels).__name__ == "_Cubins" for e in experts)
        names = {kernel.name for e in experts for kernel in e.fused.kernels.kernels.values()}
        gate_up, down = _kernels(label)
        assert f"{gate_up}_fp32" in names and f"{down}_bf16" in names
        config = greedy(8)
        assert (
            generate_text(fused, PROMPT, config).token_ids
            == generate_text(in_torch, PROMPT, config).token_ids
        )
    finally:
        fused.close()
        in_torch.close()
