"""GPTQ and AWQ int4 checkpoints as published (Qwen/Qwen3-30B-A3B-GPTQ-Int4, AWQ releases): int32
`qweight`/`qzeros`, fp16 `scales` (and GPTQ's `g_idx`) per quantized Linear. The routed experts stay
in int4 end to end; the resident Linears are dequantized at load.

The test encodes a tiny qwen3_moe into each layout with its own packer (GPTQ v1 symmetric, GPTQ v1
act-order, GPTQ v2, AWQ GEMM). Reference: transformers' forward on the dequantized weights (a float32
folder without quantization_config, loaded with `from_pretrained`); the engine's logits equal it at
fp32 1e-4 and 32 greedy tokens are identical, with a quarter of the experts cached on a simulated link."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.errors import InvalidConfigError
from engine.formats.int4 import AWQ_ORDER, Int4Weight, dequantize
from engine.loader import load_model
from engine.model.check import check_model_folder
from engine.tiny.models import build_tiny_model, save_tiny_model
from tests.engine.exactness import assert_matches_reference, quarter_cached, save_published

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 128, 5]
GROUP = 128
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)
# As the published configs have them (Qwen/Qwen3-30B-A3B-GPTQ-Int4; AutoAWQ GEMM releases).
CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True},
    "gptq_act_order": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": True,
        "sym": False,
    },
    "gptq_v2": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq_v2",
    },
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True},
}


def pack(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """8 codes (0..15) per int32 along `dim`, low bits first."""
    codes = codes.long().movedim(dim, -1)
    words = (codes.unflatten(-1, (-1, 8)) << SHIFTS).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def encode(weight: torch.Tensor, variant: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`W [out, in]` in `variant`'s published tensors, and the weight they hold, `[out, in]` float32."""
    w = weight.float().t()  # [in, out], as the checkpoints hold it
    inputs, out = w.shape
    groups = inputs // GROUP
    g_idx = torch.arange(inputs) // GROUP
    if variant == "gptq_act_order":  # groups over a permutation of the inputs, as desc_act makes them
        g_idx = g_idx[torch.randperm(inputs, generator=torch.Generator().manual_seed(out + inputs))]
    scales, zeros = torch.empty(groups, out), torch.empty(groups, out, dtype=torch.long)
    for g in range(groups):
        rows = w[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        if variant == "gptq":  # symmetric: zero 8
            scales[g], zeros[g] = (torch.maximum(-lo, hi) / 7.5).clamp_min(1e-8), 8
        else:
            scales[g] = ((hi - lo) / 15).clamp_min(1e-8)
            zeros[g] = (-lo / scales[g]).round().clamp(1, 15)  # v1 cannot store a zero of 0
    scales = scales.half()
    q = (w / scales.float()[g_idx]).round() + zeros[g_idx]
    q = q.clamp(0, 15).long()
    held = ((q - zeros[g_idx]).float() * scales.float()[g_idx]).t().contiguous()
    if variant == "awq":
        order = torch.tensor(AWQ_ORDER)  # nibble i holds column AWQ_ORDER[i] of its 8
        interleave = lambda t: t.unflatten(-1, (-1, 8))[..., order].flatten(-2)  # noqa: E731
        return {
            "qweight": pack(interleave(q), 1),
            "qzeros": pack(interleave(zeros), 1),
            "scales": scales,
        }, held
    stored_zeros = zeros if variant == "gptq_v2" else zeros - 1  # v1 stores zero - 1
    tensors = {"qweight": pack(q, 0), "qzeros": pack(stored_zeros, 1), "scales": scales}
    tensors["g_idx"] = g_idx.to(torch.int32)
    return tensors, held


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Attention and expert matrices; embeddings, norms, routers and lm_head stay as floats."""
    return tensor.dim() == 2 and name.endswith("_proj.weight")


def write_int4_model(folder, reference, variant: str):
    """A tiny qwen3_moe folder in `variant`'s published format, and `reference`: the same weights
    dequantized, as a float32 folder without quantization_config."""
    model = build_tiny_model("qwen3_moe", seed=3, hidden_size=256, moe_intermediate_size=256, head_dim=64)
    for out in (folder, reference):
        save_tiny_model(model, out, layout="per_expert", dtype=torch.float16)
    stored, tensors, dequantized = load_file(folder / "model.safetensors"), {}, {}
    for name, weight in stored.items():
        if not is_quantized(name, weight):
            tensors[name], dequantized[name] = weight, weight.float()
            continue
        base = name.removesuffix(".weight")
        packed, dequantized[name] = encode(weight, variant)
        tensors.update({f"{base}.{key}": value for key, value in packed.items()})
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    save_published(folder, tensors, CONFIGS[variant])
    return folder


@pytest.fixture(scope="module", params=["gptq", "gptq_act_order", "awq"])
def int4_folders(request, tmp_path_factory):
    reference = tmp_path_factory.mktemp("reference")
    folder = write_int4_model(tmp_path_factory.mktemp(request.param), reference, request.param)
    return folder, reference, request.param


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_dequantize_reads_each_published_layout(variant):
    weight = torch.randn(64, 256)
    packed, held = encode(weight, variant)
    fmt = {"awq": "awq", "gptq_v2": "gptq_v2"}.get(variant, "gptq")
    g_idx = packed["g_idx"][None] if variant == "gptq_act_order" else None
    view = Int4Weight(packed["qweight"], packed["qzeros"], packed["scales"], g_idx, fmt, (64, 256))
    assert torch.equal(dequantize(view), held)
    assert (held - weight).abs().max() < 0.1 * weight.abs().max()


def test_logits_and_greedy_tokens_equal_the_dequantized_model(int4_folders):
    folder, reference_folder, _ = int4_folders
    reference = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32).eval()
    model = load_model(folder, quarter_cached())
    try:
        assert model.cache.n_slots == 4 < model.store.total_experts  # the cache must evict
        assert_matches_reference(model, reference, PROMPT, new_tokens=32)
        assert model.cache.stats.total().misses > 4
    finally:
        model.close()


def test_the_experts_stay_in_int4(int4_folders):
    folder, _, variant = int4_folders
    model = load_model(folder, quarter_cached())
    try:
        fields = {f.name: f for f in model.store.layout_of(0).fields}
        assert fields["gate_up_proj"].dtype == torch.int32 and fields["gate_up_proj"].weight_shape == (
            512,
            256,
        )
        assert fields["gate_up_proj.scales"].shape == (2, 512)
        assert ("gate_up_proj.g_idx" in fields) == (variant == "gptq_act_order")
        weights = 3 * 256 * 256
        extras = 3 * 2 * 256 * (2 + 0.5) + (3 * 256 * 4 if variant == "gptq_act_order" else 0)
        assert model.store.expert_nbytes <= weights / 2 + extras + 8 * 64  # half a byte a weight
        # the packed words are the checkpoint's own: gate's columns, then up's
        stored = load_file(folder / "model.safetensors")
        views = model.store.views(1, 5)
        prefix = "model.layers.1.mlp.experts.5."
        up = views["gate_up_proj"]
        half = up.qweight.shape[1] // 2
        assert torch.equal(up.qweight[:, half:], stored[prefix + "up_proj.qweight"])
        assert torch.equal(up.qzeros[:, up.qzeros.shape[1] // 2 :], stored[prefix + "up_proj.qzeros"])
        assert torch.equal(up.scales[:, 256:], stored[prefix + "up_proj.scales"])
        assert torch.equal(views["down_proj"].qweight, stored[prefix + "down_proj.qweight"])
    finally:
        model.close()


def test_the_folder_check_accepts_the_folder(int4_folders):
    check = check_model_folder(int4_folders[0])
    assert check.ok, check.problems


def test_int4_experts_refuse_a_second_quantization(int4_folders, no_link_thread_left):
    with pytest.raises(InvalidConfigError, match=r"quantized already.*--expert-dtype native"):
        load_model(int4_folders[0], quarter_cached("int8"))


def test_the_model_says_its_experts_are_int4_and_substitutes_are_refused(int4_folders):
    from engine.errors import InvalidRequestError

    folder, _, _ = int4_folders
    model = load_model(folder, quarter_cached())
    try:
        assert model.info().expert_dtype.startswith("int4 (")
        with pytest.raises(InvalidRequestError, match="--spec self or draft"):
            model.substitutes(4)
    finally:
        model.close()
