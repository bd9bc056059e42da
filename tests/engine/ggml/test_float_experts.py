"""ggml's kernels on a safetensors checkpoint's experts (`--kernels auto` on the CPU): BF16 and F16
floats kept as ggml rows of the same numbers, gpt-oss's MXFP4 blocks with its biases, each layer's
routes through `ggml_mul_mat_id`; FP8, float32 and the engine's own int8 stay on the exact kernels
and the model says so."""

import dataclasses

import pytest
import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.ggml import kernels as ggml_kernels
from engine.ggml import library as ggml_library
from engine.loader import load_model
from engine.moe.layer import OffloadedExperts
from engine.tiny.models import build_tiny_model, save_tiny_model
from tests.engine.formats.test_fp8 import write_fp8_model
from tests.engine.store.test_from_mxfp4 import write_mxfp4_model

needs_ggml = pytest.mark.skipif(not ggml_library.available()[0], reason="ggml's library cannot run here")
PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 128, 5]
AUTO = OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse("all"), kernels="auto")
GREEDY = GenerationConfig(max_new_tokens=10, sampling=SamplingConfig(greedy=True), ignore_eos=True)


def _save(folder, model_type: str, dtype: torch.dtype, layout: str = "per_expert"):
    model = build_tiny_model(model_type, seed=1, hidden_size=64, intermediate_size=64)
    return save_tiny_model(model, folder, layout=layout, dtype=dtype)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = tmp_path_factory.mktemp("float-experts")
    return {
        "qwen3 bf16": _save(made / "qwen3-bf16", "qwen3_moe", torch.bfloat16),
        # fused [E, in, out] experts with biases and a clamped gate
        "gpt-oss bf16": _save(made / "gpt-oss-bf16", "gpt_oss", torch.bfloat16, "fused"),
        "mixtral f16": _save(made / "mixtral-f16", "mixtral", torch.float16),
        "gpt-oss mxfp4": write_mxfp4_model(made / "gpt-oss-mxfp4"),
        "qwen3 f32": _save(made / "qwen3-f32", "qwen3_moe", torch.float32),
    }


def _layers(model) -> list[OffloadedExperts]:
    return [m for m in model.hf_model.modules() if isinstance(m, OffloadedExperts)]


def _logits(model) -> torch.Tensor:
    return model.forward(torch.tensor(PROMPT), model.new_kv_cache(), logits_to_keep=0).float()


def _routed_calls(monkeypatch) -> list[str]:
    """The names of ggml's routed products called from now on (a projection each, or a whole
    SwiGLU expert in float32)."""
    calls = []
    for name in ("linear_routed", "routed_swiglu"):
        real = getattr(ggml_kernels, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ggml_kernels, name, counted)
    return calls


@needs_ggml
@pytest.mark.parametrize("name", ["qwen3 bf16", "gpt-oss bf16", "mixtral f16"])
def test_float_experts_are_ggml_rows_of_the_same_numbers_computed_by_mul_mat_id(folders, name, monkeypatch):
    """Each weight in ggml rows of the checkpoint's own type holds the exact store's numbers,
    `(out, in)` whatever the family's orientation; every layer's routes go through ggml; computed
    in float32 (as a GGUF with ggml's kernels), the logits stay within the rounding of activations
    to the weights' type of the exact kernels' in float32 on the same weights."""
    exact = load_model(folders[name], dataclasses.replace(AUTO, kernels="exact", dtype="float32"))
    fast = load_model(folders[name], AUTO)
    try:
        assert (
            exact.config.kernels == "exact" and fast.config.kernels == "ggml" and fast.dtype == torch.float32
        )
        layers = _layers(fast)
        assert layers and all(m.grouped_in_ggml for m in layers)
        layer = layers[0].layer
        kept = exact.store.layout_of(layer).views(exact.store.layer_buffer(layer)[3])
        rows = fast.store.layout_of(layer).views(fast.store.layer_buffer(layer)[3])
        stored = torch.float16 if name == "mixtral f16" else torch.bfloat16
        for field in fast.store.layout_of(layer).fields:
            if field.ggml_type is None:  # a bias, as it is
                assert torch.equal(rows[field.name], kept[field.name])
                continue
            weight = kept[field.name].T if layers[0].is_transposed else kept[field.name]
            assert torch.equal(rows[field.name].data.view(stored).float(), weight.float())
        calls = _routed_calls(monkeypatch)
        want, got = _logits(exact), _logits(fast)
        scale = want.abs().max()
        tolerance = 2e-2 if stored == torch.bfloat16 else 2e-3  # ggml rounds activations to the type
        assert ((got - want).abs().max() / scale) < tolerance
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8  # a near-tie may flip
        reply = generate_text(fast, PROMPT, GREEDY)
        # every layer's routes through ggml: one call a layer, or the whole step as one ggml graph
        # (a standard decoder in float32, its matrices as ggml rows too, as a GGUF's)
        whole = {path for path in reply.stats.step_paths if path.startswith("ggml")}
        assert len(calls) >= len(layers) or whole, reply.stats.step_paths
    finally:
        exact.close()
        fast.close()


@needs_ggml
def test_mxfp4_experts_go_through_ggml_with_their_biases_as_llama_cpp_computes_them(folders, monkeypatch):
    """gpt-oss's MXFP4 blocks, used in place (interleaved where llama.cpp interleaves them here),
    its biases added per route: the activations in 8 bits as llama.cpp computes MXFP4, so the
    typical logit row stays within a few percent of the exact kernels' and the argmax mostly
    agrees (a near-tie in routing may flip)."""
    exact = load_model(folders["gpt-oss mxfp4"], dataclasses.replace(AUTO, kernels="exact"))
    fast = load_model(folders["gpt-oss mxfp4"], AUTO)
    try:
        assert fast.config.kernels == "ggml" and all(m.grouped_in_ggml for m in _layers(fast))
        fields = {f.name: f.packing for f in fast.store.layout_of(_layers(fast)[0].layer).fields}
        assert fields["gate_up_proj"] in ("ggml", "ggml-x8") and fields["gate_up_proj_bias"] is None
        calls = _routed_calls(monkeypatch)
        want, got = _logits(exact), _logits(fast)
        assert calls == ["linear_routed"] * 2 * len(_layers(fast))  # the biases between the products
        row_error = (got - want).abs().max(dim=-1).values / want.abs().max()
        assert row_error.median() < 0.05
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
        monkeypatch.undo()
        no_bias = _layers(fast)[0]
        no_bias.__dict__["has_bias"] = False  # the biases matter: without them the output moves
        assert not torch.allclose(_logits(fast), got, atol=1e-3)
    finally:
        exact.close()
        fast.close()


@needs_ggml
def test_what_ggml_cannot_hold_as_it_is_stays_on_the_exact_kernels_and_says_so(folders, tmp_path, caplog):
    """float32 (the verification precision) and FP8 under auto; a BF16 checkpoint computed in
    float16 (its numbers would round) or its experts quantized to int8 (its matrices then stay
    ggml's); a BF16 checkpoint over a simulated link; `--kernels ggml` asked of float32 weights:
    the exact kernels, named in the model's config (which the stats report)."""
    fp8 = write_fp8_model(tmp_path / "fp8", tmp_path / "reference")
    cases = [
        (folders["qwen3 f32"], AUTO, "exact"),
        (fp8, AUTO, "exact"),
        (folders["qwen3 bf16"], dataclasses.replace(AUTO, dtype="float16"), "ggml"),
        (folders["qwen3 bf16"], dataclasses.replace(AUTO, expert_dtype="int8"), "ggml"),
        # a simulated link: the CPU stands in for a GPU, whose layout and kernels the experts keep
        (
            folders["qwen3 bf16"],
            dataclasses.replace(AUTO, expert_budget=ExpertBudget(experts=8), sim_link_gbps=1.0),
            "exact",
        ),
        (folders["qwen3 f32"], dataclasses.replace(AUTO, kernels="ggml"), "exact"),
    ]
    for folder, config, kernels in cases:
        model = load_model(folder, config)
        try:
            assert model.config.kernels == kernels, (folder.name, config)
            assert not any(m.grouped_in_ggml for m in _layers(model))
        finally:
            model.close()
    assert "the exact kernels do" in caplog.text  # said where ggml was asked for by name


@needs_ggml
def test_symmetric_gptq_experts_become_q4_0_rows_of_the_same_numbers(tmp_path):
    """A symmetric GPTQ checkpoint (Qwen's GPTQ-Int4 releases' config) under auto: each expert's
    int4 weight becomes ggml Q4_0 rows whose gguf reference dequantization equals the int4 one
    exactly, computed by ggml (8-bit activations, as llama.cpp computes Q4_0); act-order and AWQ
    (asymmetric) stay on the exact kernels."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    from engine.formats.int4 import dequantize
    from tests.engine.store.test_gptq_awq import write_int4_model

    folders = {v: write_int4_model(tmp_path / v, tmp_path / f"{v}-reference", v) for v in ("gptq", "awq")}
    exact = load_model(folders["gptq"], dataclasses.replace(AUTO, kernels="exact", dtype="float32"))
    fast = load_model(folders["gptq"], AUTO)
    try:
        assert fast.config.kernels == "ggml" and all(m.grouped_in_ggml for m in _layers(fast))
        layer = _layers(fast)[0].layer
        kept = exact.store.layout_of(layer).views(exact.store.layer_buffer(layer)[5])
        rows = fast.store.layout_of(layer).views(fast.store.layer_buffer(layer)[5])
        for field in fast.store.layout_of(layer).fields:
            assert field.ggml_type == QT.Q4_0
            reference = quants.dequantize(rows[field.name].data.numpy(), QT.Q4_0)
            assert torch.equal(torch.from_numpy(reference), dequantize(kept[field.name]))
        want, got = _logits(exact), _logits(fast)
        row_error = (got - want).abs().max(dim=-1).values / want.abs().max()
        assert row_error.median() < 0.05 and (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75
    finally:
        exact.close()
        fast.close()
    awq = load_model(folders["awq"], AUTO)
    try:
        assert awq.config.kernels == "exact"
    finally:
        awq.close()
