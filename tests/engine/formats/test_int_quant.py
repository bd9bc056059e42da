"""Group-wise int8/int4 experts: error bounds, `linear`, mixed-dtype layouts and quantized models."""

import pytest
import torch
import torch.nn.functional as F

from engine.config import EXPERT_DTYPES, ExpertBudget, OffloadConfig
from engine.errors import InvalidRequestError
from engine.formats.int_quant import (
    QUANT_DTYPES,
    QuantSpec,
    dequantize,
    group_size_for,
    linear,
    quantize_into,
    quantized_fields,
)
from engine.formats.layout import ALIGN, ExpertLayout
from engine.generation import GenerationConfig, generate_text
from engine.loader import load_model
from engine.sampling import SamplingConfig
from engine.store.host_store import quantize_store
from engine.tiny.models import TINY_ARCHITECTURES, build_tiny_model, save_tiny_model
from tests.engine.cache_helpers import SHAPES

INT8, INT4 = QuantSpec(bits=8), QuantSpec(bits=4)
# (shape, group): a full group, a row shorter than a group, a row that 64 does not divide
# (groups of 48), and an odd row (int4 falls back to int8 codes).
SHAPES_AND_GROUPS = [((24, 192), 64), ((16, 32), 32), ((12, 96), 48), ((5, 7), 7)]


def quantized(weight: torch.Tensor, spec: QuantSpec, dtype: torch.dtype = torch.float32):
    """`weight` quantized into a fresh buffer: (its views, the layout)."""
    fields = quantized_fields("w", tuple(weight.shape), spec, dtype)
    layout = ExpertLayout.from_fields(fields, spec)
    views = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    quantize_into(weight, views, "w", spec)
    return views, layout


@pytest.mark.parametrize("spec", [INT8, INT4], ids=["int8", "int4"])
@pytest.mark.parametrize(("shape", "group"), SHAPES_AND_GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_weight_is_within_half_a_step_of_its_group(spec, shape, group, dtype):
    weight = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    views, _ = quantized(weight, spec, dtype)
    assert group_size_for(shape[-1], spec) == group
    restored = dequantize(views, "w", shape, spec, torch.float32)
    step = views["w.scales"].float().repeat_interleave(group, dim=-1)  # each weight's group scale
    error = (restored - weight.float()).abs()
    assert torch.all(error <= step / 2 + 1e-6 * weight.float().abs() + 1e-9)
    # And the step is what the bits give: the group's range over 2^bits - 1 levels (or 255 when the
    # odd row falls back to int8), at most one rounding of the stored dtype above it.
    levels = 2 ** (8 if shape[-1] % 2 else spec.bits) - 1
    groups = weight.float().view(shape[0], -1, group)
    exact = (groups.amax(-1) - groups.amin(-1)) / levels
    assert torch.all(views["w.scales"].float() >= exact)
    assert torch.allclose(views["w.scales"].float(), exact, rtol=2**-7)


def test_packed_fields_replace_a_weight():
    assert quantized_fields("down_proj", (64, 32), INT8, torch.bfloat16) == [
        ("down_proj.qweight", (64, 32), torch.int8),
        ("down_proj.scales", (64, 1), torch.bfloat16),
        ("down_proj.offsets", (64, 1), torch.bfloat16),
    ]
    assert quantized_fields("gate_up_proj", (64, 256), INT4, torch.float32) == [
        ("gate_up_proj.qweight", (64, 128), torch.uint8),
        ("gate_up_proj.scales", (64, 4), torch.float32),
        ("gate_up_proj.offsets", (64, 4), torch.float32),
    ]
    # A row of odd length cannot be split into nibble pairs: int8 codes.
    assert quantized_fields("w", (4, 9), INT4, torch.float32)[0] == ("w.qweight", (4, 9), torch.int8)


def test_int4_bytes_hold_a_rows_two_halves():
    """The stored format (device-agnostic, and what the store cache keeps): byte j of a row holds
    element j in its low nibble and element j + C/2 in its high one."""
    codes = torch.arange(32) % 16  # one group whose range is 0..15: scale 1, offset 0
    views, _ = quantized(codes.float().view(1, 32), QuantSpec(bits=4, group_size=32))
    assert views["w.scales"].item() == 1.0 and views["w.offsets"].item() == 0.0
    assert views["w.qweight"].tolist() == [[(j % 16) | ((j + 16) % 16) << 4 for j in range(16)]]


def test_a_constant_group_is_exact():
    weight = torch.full((4, 64), 0.25)
    for spec in (INT8, INT4):
        views, _ = quantized(weight, spec)
        assert torch.equal(dequantize(views, "w", (4, 64), spec, torch.float32), weight)


@pytest.mark.parametrize("spec", [INT8, INT4], ids=["int8", "int4"])
@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_linear_is_dequantize_then_matmul(spec, transposed, rows):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 64, generator=generator)  # [out, in], or [in, out] when transposed
    views, _ = quantized(weight, spec)
    x = torch.randn(rows, 96 if transposed else 64, generator=generator)
    dense = dequantize(views, "w", (96, 64), spec, torch.float32)
    expected = x @ dense if transposed else F.linear(x, dense)
    assert torch.equal(linear(x, views, "w", transposed), expected)


@pytest.mark.parametrize("spec", [INT8, INT4], ids=["int8", "int4"])
def test_half_precision_linear_is_close_to_dequantize_then_matmul(spec):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    views, _ = quantized(weight, spec, torch.bfloat16)
    x = torch.randn(4, 64, generator=generator).bfloat16()
    y = linear(x, views, "w", transposed=False)
    assert y.dtype == torch.bfloat16
    expected = F.linear(x.float(), dequantize(views, "w", (96, 64), spec, torch.float32))
    torch.testing.assert_close(y.float(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_views_give_exactly_the_experts_own_results(dtype):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 32, generator=generator).to(dtype)
    x = torch.randn(5, 32, generator=generator).to(dtype)
    assert torch.equal(linear(x, {"w": weight}, "w", transposed=False), F.linear(x, weight))
    x_t = torch.randn(5, 48, generator=generator).to(dtype)
    assert torch.equal(linear(x_t, {"w": weight}, "w", transposed=True), x_t @ weight)


def test_dequantize_checks_the_fields_against_the_spec():
    views, _ = quantized(torch.randn(8, 64), INT8)
    with pytest.raises(ValueError, match="int4"):
        dequantize(views, "w", (8, 64), INT4, torch.float32)


def test_specs_and_expert_dtypes():
    assert QUANT_DTYPES == EXPERT_DTYPES == ("native", "int8", "int4")
    assert QuantSpec.from_dtype("native") is None
    assert QuantSpec.from_dtype("int4") == QuantSpec(bits=4, group_size=64)
    for bad in (dict(bits=3), dict(bits=8, group_size=0)):
        with pytest.raises(ValueError):
            QuantSpec(**bad)
    with pytest.raises(InvalidRequestError, match="int8"):
        OffloadConfig(expert_dtype="fp8").validate()


def test_mixed_dtype_layout_keeps_every_field_aligned():
    fields = [
        ("a.qweight", (3, 5), torch.int8),
        ("a.scales", (3, 1), torch.bfloat16),
        ("bias", (7,), torch.float32),
    ]
    layout = ExpertLayout.from_fields(fields, INT8)
    assert [f.offset % ALIGN for f in layout.fields] == [0, 0, 0]
    assert layout.nbytes % ALIGN == 0 and layout.quant == INT8
    views = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    assert [(tuple(v.shape), v.dtype) for v in views.values()] == [(s, d) for _, s, d in fields]
    assert ExpertLayout.from_shapes(SHAPES, torch.float32).quant is None


def test_quantize_store_converts_weights_and_copies_biases(store):
    quant_store = quantize_store(store, INT4)
    assert quant_store.layout.quant == INT4 and store.layout.quant is None
    assert quant_store.layer_indices == store.layer_indices
    for layer, expert in [(0, 0), (2, 5)]:
        native, views = store.views(layer, expert), quant_store.views(layer, expert)
        assert torch.equal(views["down_proj_bias"], native["down_proj_bias"])
        assert "gate_up_proj" not in views
        restored = dequantize(views, "gate_up_proj", SHAPES["gate_up_proj"], INT4, torch.float32)
        assert (restored - native["gate_up_proj"]).abs().max() <= views[
            "gate_up_proj.scales"
        ].max() / 2 + 1e-6
    with pytest.raises(ValueError, match="already quantized"):
        quantize_store(quant_store, INT8)


def test_store_moves_to_a_device(store):
    assert store.to("cpu") is store
    moved = quantize_store(store, INT8).to("meta")  # the same copies a CUDA device gets
    assert moved.device == torch.device("meta") and moved.layout.quant == INT8
    assert moved.views(1, 2)["down_proj.qweight"].device == torch.device("meta")
    direct = quantize_store(store, INT8, device="meta")  # layer by layer, never whole on the host
    assert direct.device == torch.device("meta") and direct.layout == moved.layout


# -- quantized models --------------------------------------------------------------------------

GREEDY_4 = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(greedy=True), ignore_eos=True)
MIN_COSINE = {"int8": 0.999, "int4": 0.97}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_quantized_models_of_every_family_load_and_generate(tmp_path, monkeypatch, model_type):
    monkeypatch.setenv("MOE_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    folder = save_tiny_model(build_tiny_model(model_type, seed=1), tmp_path / model_type)
    ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(0))
    logits, expert_nbytes = {}, {}
    for expert_dtype in ("native", "int8", "int4"):
        config = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=4), expert_dtype=expert_dtype)
        model = load_model(folder, config)
        try:
            info = model.info()
            assert info.expert_dtype == expert_dtype
            expert_nbytes[expert_dtype] = info.expert_nbytes
            logits[expert_dtype] = model.forward(ids, model.new_kv_cache(), logits_to_keep=0)
            if expert_dtype == "int4":  # decoding, too, from quantized cache slots
                assert generate_text(model, ids.tolist(), GREEDY_4).stats.generated_tokens == 4
        finally:
            model.close()
    assert expert_nbytes["int4"] < expert_nbytes["int8"] < expert_nbytes["native"]
    for expert_dtype in ("int8", "int4"):
        assert cosine(logits[expert_dtype], logits["native"]) > MIN_COSINE[expert_dtype]
