"""gpt-oss as OpenAI ships it: MXFP4 experts (`*_blocks`/`*_scales` U8 tensors) loaded and kept
in MXFP4 end to end. The logits equal transformers' own loading of the folder (which dequantizes
MXFP4 on CPU) at fp32 1e-4 and 32 greedy tokens are identical, with a quarter of the experts
cached on a simulated link."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from engine.errors import CorruptCheckpointError, InvalidConfigError
from engine.formats.gguf.blocks import dequantize
from engine.formats.mxfp4_experts import repack_to_ggml
from engine.loader import load_model
from engine.model.checkpoint import Checkpoint
from engine.tiny.models import build_tiny_model, save_tiny_model
from tests.engine.exactness import assert_matches_reference, quarter_cached, save_published

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 128, 5]
HIDDEN, INTER = 64, 64  # multiples of 32: whole MXFP4 blocks, two per row
# As openai/gpt-oss-20b's config.json has it.
QUANTIZATION_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[E, out, in]` -> OpenAI's `blocks [E, out, in/32, 16]` and E8M0 `scales [E, out, in/32]`:
    the smallest power-of-two scale that fits each block's largest weight into E2M1 (±6), nearest
    code, byte j holding weight 2j in its low nibble and 2j + 1 in its high one."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    values = torch.tensor(FP4_VALUES)
    codes = (groups / torch.exp2(exponent)[..., None]).unsqueeze(-1).sub(values).abs().argmin(-1)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def write_mxfp4_model(folder):
    """A tiny gpt-oss folder in the published format: MXFP4 experts, everything else in BF16."""
    model = build_tiny_model("gpt_oss", seed=1, intermediate_size=INTER, hidden_size=HIDDEN)
    save_tiny_model(model, folder, layout="fused", dtype=torch.bfloat16)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).transpose(1, 2)  # transformers' [E, in, out] -> [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = encode_mxfp4(weight)
    save_published(folder, tensors, QUANTIZATION_CONFIG)
    return folder


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    return write_mxfp4_model(tmp_path_factory.mktemp("gpt-oss-mxfp4"))


def test_repacked_blocks_dequantize_as_transformers_does():
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 96, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 140, (3, 96, 4), dtype=torch.uint8, generator=generator)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    for expert in range(3):
        rows = repack_to_ggml(blocks[expert], scales[expert])  # [out, 4 * 17]
        got = dequantize(rows, QT.MXFP4, (96, 128), torch.float32)
        assert torch.equal(got, expected[expert].T)
        # gguf's own numpy reference reads the repacked bytes the same way
        numpy = quants.dequantize(rows.numpy(), QT.MXFP4)
        np.testing.assert_array_equal(numpy, expected[expert].T.numpy())


def test_logits_and_greedy_tokens_equal_transformers_loading(mxfp4_folder):
    reference = AutoModelForCausalLM.from_pretrained(mxfp4_folder, dtype=torch.float32).eval()
    model = load_model(mxfp4_folder, quarter_cached())
    try:
        assert model.cache.n_slots == 4 < model.store.total_experts  # the cache must evict
        assert_matches_reference(model, reference, PROMPT)
        assert model.cache.stats.total().misses > 4
    finally:
        model.close()


def test_experts_computed_in_groups_from_device_slots_equal_transformers(mxfp4_folder, monkeypatch):
    """As on CUDA: every expert in a device slot, computed in groups (the prefill) and through the
    slot table (the decode steps); the MXFP4 fields' `(out, in)` rows read as gpt-oss's `[in, out]`."""
    from tests.engine.moe.test_fused_experts import load_emulating_cuda

    reference = AutoModelForCausalLM.from_pretrained(mxfp4_folder, dtype=torch.float32).eval()
    model = load_emulating_cuda(mxfp4_folder, monkeypatch)
    try:
        assert_matches_reference(model, reference, PROMPT)
    finally:
        model.close()


def test_the_experts_stay_in_mxfp4(mxfp4_folder):
    model = load_model(mxfp4_folder, quarter_cached())
    try:
        assert model.info().disk_layout == "mxfp4 mlp.experts"
        fields = {f.name: f for f in model.store.layout_of(0).fields}
        assert (fields["gate_up_proj"].ggml_type, fields["down_proj"].ggml_type) == (QT.MXFP4, QT.MXFP4)
        assert fields["gate_up_proj"].weight_shape == (2 * INTER, HIDDEN)  # (out, in)
        assert fields["down_proj"].weight_shape == (HIDDEN, INTER)
        assert fields["gate_up_proj_bias"].dtype == torch.float32 and fields["gate_up_proj_bias"].shape == (
            2 * INTER,
        )
        weights = 3 * INTER * HIDDEN
        biases = 4 * (2 * INTER + HIDDEN)
        assert fields["gate_up_proj"].nbytes + fields["down_proj"].nbytes == weights * 4.25 / 8
        assert model.store.expert_nbytes <= weights * 4.25 / 8 + biases + 4 * 64  # + field alignment
    finally:
        model.close()


def test_mxfp4_experts_refuse_a_second_quantization(mxfp4_folder, no_link_thread_left):
    with pytest.raises(InvalidConfigError, match=r"quantized already.*--expert-dtype native"):
        load_model(mxfp4_folder, quarter_cached("int4"))


def test_mxfp4_blocks_are_never_read_as_floats(mxfp4_folder):
    with Checkpoint(mxfp4_folder) as checkpoint:
        name = "model.layers.0.mlp.experts.down_proj_blocks"
        assert checkpoint.read_index(name, 0).dtype == torch.uint8
        with pytest.raises(CorruptCheckpointError, match="stored as U8"):
            checkpoint.read(name, torch.float32)


def test_blocks_that_disagree_with_the_config_are_a_corrupt_checkpoint(tmp_path, no_link_thread_left):
    folder = write_mxfp4_model(tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :32].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match=rf"{name} is U8 \(8, 32, 2\).*holds U8 \(8, 64, 2\)"):
        load_model(folder, quarter_cached())


def test_the_folder_check_accepts_a_published_mxfp4_folder(mxfp4_folder):
    from engine.model.check import check_model_folder

    check = check_model_folder(mxfp4_folder)
    assert check.ok, check.problems
    assert check.model_type == "gpt_oss"
