"""compressed-tensors checkpoints as llm-compressor publishes them (RedHatAI/Qwen3-30B-A3B-FP8-dynamic,
RedHatAI/Qwen3-30B-A3B-quantized.w4a16): FP8 `float-quantized` weights with per-channel (or
per-tensor, or block) `weight_scale`, and int4 `pack-quantized` `weight_packed`/`weight_scale`/
`weight_zero_point`/`weight_g_idx`/`weight_shape`. The routed experts stay FP8 or int4 end to end;
the resident Linears are dequantized at load; lm_head and the routers (`ignore`) stay as floats.

The test writes each layout with its own packer, following compressed-tensors' `pack_to_int32`
(signed codes plus 8, eight per int32 along the input dim, low bits first; zero points packed
along the output dim). Reference: transformers' forward on the dequantized weights (a float32
folder without quantization_config); the engine's logits equal it at fp32 1e-4 and 32 greedy
tokens are identical, with a quarter of the experts cached on a simulated link."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CorruptCheckpointError, UnsupportedQuantizationError
from engine.formats.int4 import CT, CT_SYM, Int4Weight, dequantize
from engine.loader import load_model
from engine.model.check import check_model_folder, config_problems
from engine.tiny.models import build_tiny_model, save_tiny_model
from tests.engine.exactness import (
    assert_quarter_cached_equals,
    quarter_cached,
    save_published,
)

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 128, 5]
GROUP = 128
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None}
INT4 = {"num_bits": 4, "type": "int", "dynamic": False, "observer": "minmax", "observer_kwargs": {}}
# variant -> (format, weight arguments), as the published config.json files have them
SCHEMES = {
    "fp8_channel": ("float-quantized", {**FP8, "strategy": "channel"}),  # *-FP8-dynamic
    "fp8_tensor": ("float-quantized", {**FP8, "strategy": "tensor"}),
    "fp8_block": ("float-quantized", {**FP8, "strategy": "block", "block_structure": [128, 128]}),
    "w4a16": ("pack-quantized", {**INT4, "strategy": "group", "group_size": GROUP, "symmetric": True}),
    "w4a16_asym_actorder": (
        "pack-quantized",
        {**INT4, "strategy": "group", "group_size": GROUP, "symmetric": False, "actorder": "group"},
    ),
    "w4a16_channel": ("pack-quantized", {**INT4, "strategy": "channel", "symmetric": True}),
}
DYNAMIC_FP8_TOKENS = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}


def quantization_config(variant: str) -> dict:
    fmt, weights = SCHEMES[variant]
    activations = DYNAMIC_FP8_TOKENS if fmt == "float-quantized" else None
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {**group, "output_activations": None}},
        "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def pack(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """compressed-tensors' `pack_to_int32`: signed 4-bit codes plus 8, eight per int32 along `dim`."""
    nibbles = (codes.long() + 8).movedim(dim, -1)
    words = (nibbles.unflatten(-1, (-1, 8)) << SHIFTS).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def encode_fp8(weight: torch.Tensor, strategy: str) -> tuple[dict, torch.Tensor]:
    """`W [out, in]` as e4m3 `weight` and bf16 `weight_scale`, and the weight they hold (float32)."""
    w = weight.float()
    out, inputs = w.shape
    if strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448.0  # [out, 1]
    elif strategy == "tensor":
        scale = w.abs().amax().reshape(1) / 448.0
    else:  # 128 × 128 blocks
        scale = w.view(out // 128, 128, inputs // 128, 128).abs().amax((1, 3)) / 448.0
    scale = scale.clamp_min(1e-12).bfloat16()
    full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1) if strategy == "block" else scale
    codes = (w / full.float()).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.float() * full.float()


def encode_int4(weight: torch.Tensor, variant: str) -> tuple[dict, torch.Tensor]:
    """`W [out, in]` in `variant`'s pack-quantized tensors, and the weight they hold (float32)."""
    w = weight.float()
    out, inputs = w.shape
    group = inputs if variant == "w4a16_channel" else GROUP
    g_idx = torch.arange(inputs) // group
    if variant == "w4a16_asym_actorder":  # groups over a permutation of the inputs
        g_idx = g_idx[torch.randperm(inputs, generator=torch.Generator().manual_seed(out + inputs))]
    count = inputs // group
    lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(count)], 1).clamp(max=0)  # [out, groups]
    hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(count)], 1).clamp(min=0)
    if variant == "w4a16_asym_actorder":
        scale = ((hi - lo) / 15).clamp_min(1e-8).bfloat16()
        zero = (-8 - (lo / scale.float()).round()).clamp(-8, 7)  # compressed-tensors: q_min - round(min/s)
    else:
        scale, zero = (torch.maximum(-lo, hi) / 7.5).clamp_min(1e-8).bfloat16(), torch.zeros(out, count)
    s, z = scale.float()[:, g_idx], zero[:, g_idx]
    q = ((w / s).round() + z).clamp(-8, 7)
    tensors = {
        "weight_packed": pack(q, 1),
        "weight_scale": scale,
        "weight_shape": torch.tensor([out, inputs]),
    }
    if variant == "w4a16_asym_actorder":
        tensors["weight_zero_point"] = pack(zero, 0)
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors, (q - z) * s


def encode(weight: torch.Tensor, variant: str) -> tuple[dict, torch.Tensor]:
    if variant.startswith("fp8"):
        return encode_fp8(weight, variant.removeprefix("fp8_"))
    return encode_int4(weight, variant)


def write_model(folder, reference, variant: str, model_type: str = "qwen3_moe"):
    """A tiny `model_type` folder in `variant`'s published format, and `reference`: the same weights
    dequantized, as a float32 folder without quantization_config."""
    shape = {"head_dim": 64} if model_type == "qwen3_moe" else {}
    model = build_tiny_model(model_type, seed=5, hidden_size=256, moe_intermediate_size=256, **shape)
    for out in (folder, reference):
        save_tiny_model(model, out, layout="per_expert", dtype=torch.bfloat16)
    stored, tensors, dequantized = load_file(folder / "model.safetensors"), {}, {}
    for name, weight in stored.items():
        if weight.dim() != 2 or not name.endswith("_proj.weight"):  # embeddings, norms, routers, lm_head
            tensors[name], dequantized[name] = weight, weight.float()
            continue
        base = name.removesuffix(".weight")
        packed, dequantized[name] = encode(weight, variant)
        tensors.update({f"{base}.{key}": value for key, value in packed.items()})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    save_published(folder, tensors, quantization_config(variant))
    return folder


@pytest.fixture(scope="module", params=["fp8_channel", "w4a16", "w4a16_asym_actorder"])
def folders(request, tmp_path_factory):
    reference = tmp_path_factory.mktemp("reference")
    folder = write_model(tmp_path_factory.mktemp(request.param), reference, request.param)
    return folder, reference, request.param


def assert_equals_reference(folder, reference_folder, tokens: int = 32) -> None:
    assert_quarter_cached_equals(folder, reference_folder, PROMPT, tokens)


@pytest.mark.parametrize("variant", ["w4a16", "w4a16_asym_actorder", "w4a16_channel"])
def test_dequantize_reads_each_pack_quantized_layout(variant):
    weight = torch.randn(64, 256)
    packed, held = encode_int4(weight, variant)
    fmt = CT if "weight_zero_point" in packed else CT_SYM
    zeros = packed.get(
        "weight_zero_point", torch.empty(0, packed["weight_scale"].shape[1], dtype=torch.int32)
    )
    g_idx = packed["weight_g_idx"][None] if "weight_g_idx" in packed else None
    view = Int4Weight(packed["weight_packed"], zeros, packed["weight_scale"], g_idx, fmt, (64, 256))
    assert torch.equal(dequantize(view), held)
    assert (held - weight).abs().max() < 0.15 * weight.abs().max()


def test_logits_and_greedy_tokens_equal_the_dequantized_model(folders):
    assert_equals_reference(*folders[:2])


def test_the_experts_stay_quantized_in_the_checkpoints_own_bytes(folders):
    folder, _, variant = folders
    model = load_model(folder, quarter_cached())
    try:
        fields = {f.name: f for f in model.store.layout_of(0).fields}
        stored = load_file(folder / "model.safetensors")
        views = model.store.views(1, 5)
        up = "model.layers.1.mlp.experts.5.up_proj."
        if variant.startswith("fp8"):
            assert fields["gate_up_proj"].dtype == torch.float8_e4m3fn and fields[
                "gate_up_proj"
            ].format.block == (
                1,
                256,
            )
            assert model.store.expert_nbytes <= 3 * 256 * 256 + 4 * 3 * 256 + 4 * 64  # a byte a weight
            data, scales = views["gate_up_proj"].data[256:], views["gate_up_proj"].scale_inv[256:]
            assert torch.equal(data.view(torch.uint8), stored[up + "weight"].view(torch.uint8))
            assert torch.equal(scales, stored[up + "weight_scale"].float())
            return
        assert fields["gate_up_proj"].format.format == (CT if "asym" in variant else CT_SYM)
        assert fields["gate_up_proj.scales"].dtype == torch.bfloat16  # as stored: no rounding to fp16
        extras = 3 * 2 * 256 * (2 + 0.5) + (3 * 256 * 4 if "actorder" in variant else 0)
        assert model.store.expert_nbytes <= 3 * 256 * 256 / 2 + extras + 8 * 64  # half a byte a weight
        gate_up = views["gate_up_proj"]
        assert torch.equal(gate_up.qweight[256:], stored[up + "weight_packed"])
        assert torch.equal(gate_up.scales[256:], stored[up + "weight_scale"])
        if "asym" in variant:
            assert torch.equal(gate_up.qzeros[32:], stored[up + "weight_zero_point"])
    finally:
        model.close()


def test_the_folder_check_accepts_the_folder(folders):
    check = check_model_folder(folders[0])
    assert check.ok, check.problems


@pytest.mark.parametrize("variant", ["fp8_tensor", "fp8_block"])
def test_fp8_per_tensor_and_block_scales(tmp_path, variant):
    folder = write_model(tmp_path / "m", tmp_path / "ref", variant)
    assert_equals_reference(folder, tmp_path / "ref", tokens=4)


def test_qwen2_moe_with_per_channel_int4_scales_and_a_shared_expert(tmp_path):
    folder = write_model(tmp_path / "m", tmp_path / "ref", "w4a16_channel", model_type="qwen2_moe")
    assert "model.layers.0.mlp.shared_expert.down_proj.weight_packed" in load_file(
        folder / "model.safetensors"
    )
    assert check_model_folder(folder).ok
    assert_equals_reference(folder, tmp_path / "ref", tokens=8)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"strategy": "tensor_group"}, "4-bit int weights with tensor_group scales"),
        ({"num_bits": 8}, "8-bit int weights in the pack-quantized format"),
        ({"format": "nvfp4-pack-quantized"}, "in the nvfp4-pack-quantized format"),
    ],
)
def test_a_scheme_it_cannot_read_is_refused_in_one_line(tmp_path, change, named, no_link_thread_left):
    folder = write_model(tmp_path / "m", tmp_path / "ref", "w4a16")
    config = json.loads((folder / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"].update({k: v for k, v in change.items() if k != "format"})
    if "format" in change:
        config["quantization_config"]["format"] = change["format"]
    (folder / "config.json").write_text(json.dumps(config))
    (problem,) = config_problems(config)
    assert named in problem and "\n" not in problem and "compressed-tensors" in problem
    assert not check_model_folder(folder).ok
    with pytest.raises(UnsupportedQuantizationError, match=named):
        load_model(folder, quarter_cached())


def test_scales_that_disagree_with_the_packed_words_are_a_corrupt_checkpoint(tmp_path, no_link_thread_left):
    folder = write_model(tmp_path / "m", tmp_path / "ref", "w4a16")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale"
    tensors[name] = tensors[name][:128].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match=r"down_proj have shapes.*'scales': \(128, 2\)"):
        load_model(folder, quarter_cached())
