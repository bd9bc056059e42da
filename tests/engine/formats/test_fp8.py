"""FP8 checkpoints as Qwen3-*-FP8 and DeepSeek-V3 publish them: F8_E4M3 Linear weights with float32
block scales (`weight_scale_inv`, 128 × 128), or one per-tensor `weight_scale`. The routed experts
stay in FP8 end to end; the resident weights are dequantized at load.

Reference: transformers' forward of the same config on the dequantized weights (written as a
float32 folder and loaded with `from_pretrained`); transformers' own FP8 loader is not used. The
engine's logits equal it at fp32 1e-4 and 32 greedy tokens are identical, with a quarter of the
experts cached on a simulated link."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import OffloadConfig
from engine.errors import CorruptCheckpointError, InvalidConfigError
from engine.formats.fp8 import Fp8Weight, dequantize
from engine.loader import load_model
from engine.model.check import check_model_folder
from engine.tiny.models import build_tiny_model, save_tiny_model
from tests.engine.exactness import (
    assert_quarter_cached_equals,
    quarter_cached,
    save_published,
)

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 128, 5]
HIDDEN = 256  # two 128-wide blocks per row
# As Qwen/Qwen3-30B-A3B-FP8's config.json has it.
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


def quantize_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`[out, in]` -> e4m3 `[out, in]` and `scale_inv [ceil(out/128), ceil(in/128)]`: per block,
    scale_inv = amax / 448 and weight_fp8 = weight / scale_inv, as the published checkpoints do."""
    out, columns = weight.shape
    scale = torch.empty(-(-out // block), -(-columns // block))
    codes = torch.empty(out, columns, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
            scale[i, j] = tile.abs().max().clamp_min(1e-12) / 448.0
            codes[i * block : (i + 1) * block, j * block : (j + 1) * block] = (tile / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return codes, scale


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The test's own reading of a block-scaled weight, tile by tile."""
    weight = codes.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            weight[i * block : (i + 1) * block, j * block : (j + 1) * block] *= scale[i, j]
    return weight


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """The releases quantize attention, dense and expert matrices (DeepSeek's kv_a_proj_with_mqa too);
    embeddings, norms, routers and lm_head stay BF16."""
    return tensor.dim() == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def write_fp8_model(
    folder, reference, inter: int = 256, per_tensor: bool = False, model_type: str = "qwen3_moe"
):
    """A tiny `model_type` folder in the published FP8 format, and `reference`: the same weights
    dequantized, as a float32 folder without quantization_config."""
    model = build_tiny_model(model_type, seed=2, hidden_size=HIDDEN, moe_intermediate_size=inter)
    for out in (folder, reference):
        save_tiny_model(model, out, layout="per_expert", dtype=torch.bfloat16)
    tensors = load_file(folder / "model.safetensors")
    dequantized = {}
    for name in list(tensors):
        weight = tensors[name]
        if not is_quantized(name, weight):
            dequantized[name] = weight.float()
            continue
        if per_tensor:
            scale = weight.float().abs().max() / 448.0
            tensors[name] = (weight.float() / scale).to(torch.float8_e4m3fn)
            tensors[name + "_scale"] = scale.reshape(1)
            dequantized[name] = tensors[name].float() * scale
        else:
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(weight)
            dequantized[name] = dequantize_blocks(tensors[name], tensors[name + "_scale_inv"])
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    quant = dict(QUANTIZATION_CONFIG)
    if per_tensor:
        del quant["weight_block_size"]
    save_published(folder, tensors, quant)
    return folder


@pytest.fixture(scope="module")
def fp8_folders(tmp_path_factory):
    reference = tmp_path_factory.mktemp("reference")
    return write_fp8_model(tmp_path_factory.mktemp("qwen3-fp8"), reference), reference


def assert_equals_reference(folder, reference_folder, tokens: int = 32) -> None:
    assert_quarter_cached_equals(folder, reference_folder, PROMPT, tokens)


def test_dequantize_reads_blocks_whole_and_partial():
    weight = torch.randn(320, 200)
    codes, scale = quantize_blocks(weight)
    expected = dequantize_blocks(codes, scale)
    assert torch.equal(dequantize(Fp8Weight(codes, scale, (128, 128))), expected)
    whole = torch.randn(256, 384)
    codes, scale = quantize_blocks(whole)
    assert torch.equal(dequantize(Fp8Weight(codes, scale, (128, 128))), dequantize_blocks(codes, scale))
    assert (dequantize_blocks(codes, scale) - whole).abs().max() < 0.07 * whole.abs().max()


def test_logits_and_greedy_tokens_equal_the_dequantized_model(fp8_folders):
    assert_equals_reference(*fp8_folders)


def test_the_experts_stay_in_fp8(fp8_folders):
    folder, _ = fp8_folders
    model = load_model(folder, quarter_cached())
    try:
        assert model.info().disk_layout == "per-expert mlp.experts"
        fields = {f.name: f for f in model.store.layout_of(0).fields}
        assert fields["gate_up_proj"].dtype == torch.float8_e4m3fn and fields["gate_up_proj"].shape == (
            512,
            256,
        )
        assert fields["gate_up_proj"].format.block == (128, 128) and fields[
            "gate_up_proj.scale_inv"
        ].shape == (4, 2)
        assert fields["down_proj"].dtype == torch.float8_e4m3fn and fields["down_proj.scale_inv"].shape == (
            2,
            2,
        )
        weights, scales = 3 * 256 * HIDDEN, 4 * (8 + 4)
        assert model.store.expert_nbytes <= weights + scales + 4 * 64  # 1 byte a weight, + field alignment
        # the packed bytes are the checkpoint's own, and the scales are its scale_inv rows
        stored = load_file(folder / "model.safetensors")
        views = model.store.views(1, 5)
        prefix = "model.layers.1.mlp.experts.5."
        assert torch.equal(
            views["gate_up_proj"].data[256:].view(torch.uint8),
            stored[prefix + "up_proj.weight"].view(torch.uint8),
        )
        assert torch.equal(views["gate_up_proj"].scale_inv[2:], stored[prefix + "up_proj.weight_scale_inv"])
        assert torch.equal(views["down_proj"].scale_inv, stored[prefix + "down_proj.weight_scale_inv"])
    finally:
        model.close()


def test_the_folder_check_accepts_a_published_fp8_folder(fp8_folders):
    check = check_model_folder(fp8_folders[0])
    assert check.ok, check.problems
    assert check.model_type == "qwen3_moe"


def test_fp8_experts_refuse_a_second_quantization(fp8_folders, no_link_thread_left):
    with pytest.raises(InvalidConfigError, match=r"quantized already.*--expert-dtype native"):
        load_model(fp8_folders[0], quarter_cached("int8"))


def test_a_gate_ending_inside_a_block_keeps_a_scale_row_per_weight_row(tmp_path):
    folder = write_fp8_model(tmp_path / "m", tmp_path / "ref", inter=192)  # 1.5 blocks
    assert_equals_reference(folder, tmp_path / "ref", tokens=0)


def test_deepseek_v3_with_partial_blocks_in_its_attention(tmp_path):
    # kv_a_proj_with_mqa is 24 × 256 here (576 × 7168 in V3: 4.5 blocks); a dense first layer
    folder = write_fp8_model(tmp_path / "m", tmp_path / "ref", model_type="deepseek_v3")
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in load_file(
        folder / "model.safetensors"
    )
    assert_equals_reference(folder, tmp_path / "ref")


def test_per_tensor_scales(tmp_path):
    folder = write_fp8_model(tmp_path / "m", tmp_path / "ref", per_tensor=True)
    assert_equals_reference(folder, tmp_path / "ref", tokens=8)


def test_scales_that_disagree_with_the_weights_are_a_corrupt_checkpoint(tmp_path, no_link_thread_left):
    folder = write_fp8_model(tmp_path / "m", tmp_path / "ref")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:1].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        CorruptCheckpointError, match=r"down_proj.weight \(256, 256\) are \(1, 2\).*make \(2, 2\)"
    ):
        load_model(folder, quarter_cached())


def test_bf16_experts_under_an_fp8_config_are_refused(tmp_path, no_link_thread_left):
    folder = save_tiny_model(build_tiny_model("qwen3_moe", hidden_size=HIDDEN), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION_CONFIG}))
    with pytest.raises(
        CorruptCheckpointError, match=r"gate_proj.weight is stored as F32, but config.json says"
    ):
        load_model(folder, quarter_cached())


def test_the_model_says_its_experts_are_fp8_and_substitutes_are_refused(fp8_folders):
    from engine.errors import InvalidRequestError

    folder, _ = fp8_folders
    model = load_model(folder, OffloadConfig(device="cpu", dtype="float32"))
    try:
        assert model.info().expert_dtype == "fp8"
        with pytest.raises(InvalidRequestError, match="--spec self or draft"):
            model.substitutes(4)
    finally:
        model.close()
