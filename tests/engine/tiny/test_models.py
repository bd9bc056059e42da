"""engine.tiny.models: every tiny architecture saves, reloads, generates and routes like a real checkpoint."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from engine.tiny.models import (
    TINY_ARCHITECTURES,
    build_tiny_model,
    make_tiny_model,
    save_tiny_model,
    tiny_config,
    tiny_tokenizer,
)

# What transformers 5.23's save_pretrained writes for the last MoE layer: an expert key and the router key.
# Granite and gpt-oss have no per-expert form on disk; their experts stay 3D tensors.
PER_EXPERT_KEYS = {
    "qwen3_moe": ("mlp.experts.3.gate_proj.weight", "mlp.gate.weight"),
    "qwen2_moe": ("mlp.experts.3.gate_proj.weight", "mlp.gate.weight"),
    "olmoe": ("mlp.experts.3.gate_proj.weight", "mlp.gate.weight"),
    "deepseek_v2": ("mlp.experts.3.gate_proj.weight", "mlp.gate.weight"),
    "deepseek_v3": ("mlp.experts.3.gate_proj.weight", "mlp.gate.weight"),
    "mixtral": ("block_sparse_moe.experts.3.w1.weight", "block_sparse_moe.gate.weight"),
    "phimoe": ("block_sparse_moe.experts.3.w1.weight", "block_sparse_moe.gate.weight"),
    "granitemoe": ("block_sparse_moe.input_linear.weight", "block_sparse_moe.router.layer.weight"),
    "gpt_oss": ("mlp.experts.gate_up_proj", "mlp.router.weight"),
}
PER_EXPERT_NAME = re.compile(r"\.experts\.\d+\.")


def _random_ids(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _saved_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as weights:
            for name in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(weights.get_slice(name).get_shape())
    return shapes


def _last_layer(model) -> str:
    return f"model.layers.{model.config.num_hidden_layers - 1}."


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def tiny_model(request):
    return build_tiny_model(request.param)


@pytest.mark.parametrize("max_shard_size", [None, "50KB"])
@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_reload_gives_identical_logits(tiny_model, layout, max_shard_size, tmp_path):
    folder = save_tiny_model(tiny_model, tmp_path, layout=layout, max_shard_size=max_shard_size)

    # Eager kernels on both sides, so only the checkpoint format is under test.
    reloaded, loading_info = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager", output_loading_info=True
    )

    assert not loading_info["missing_keys"]
    assert not loading_info["unexpected_keys"]
    input_ids = _random_ids(24)
    torch.testing.assert_close(
        _logits(reloaded, input_ids), _logits(tiny_model, input_ids), atol=1e-5, rtol=0
    )
    index_file = folder / "model.safetensors.index.json"
    if max_shard_size is None:
        assert not index_file.exists()
        assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]
    else:
        weight_map = json.loads(index_file.read_text())["weight_map"]
        assert len(set(weight_map.values())) > 1
        assert set(weight_map) == set(_saved_shapes(folder))


def test_per_expert_layout_writes_transformers_names(tiny_model, tmp_path):
    folder = save_tiny_model(tiny_model, tmp_path, layout="per_expert")
    shapes = _saved_shapes(folder)
    model_type = tiny_model.config.model_type
    expert_key, router_key = (_last_layer(tiny_model) + key for key in PER_EXPERT_KEYS[model_type])

    assert expert_key in shapes
    assert router_key in shapes
    if model_type in ("granitemoe", "gpt_oss"):
        assert len(shapes[expert_key]) == 3
        assert not any(PER_EXPERT_NAME.search(name) for name in shapes)
    else:
        assert len(shapes[expert_key]) == 2
        assert not any(name.endswith("experts.gate_up_proj") for name in shapes)


def test_fused_layout_writes_in_memory_names(tiny_model, tmp_path):
    folder = save_tiny_model(tiny_model, tmp_path, layout="fused", max_shard_size="50KB")
    shapes = _saved_shapes(folder)

    expected = {name: tuple(tensor.shape) for name, tensor in tiny_model.state_dict().items()}
    assert shapes == expected
    assert not any(PER_EXPERT_NAME.search(name) for name in shapes)
    experts = next(
        name for name in shapes if name.startswith(_last_layer(tiny_model)) and "gate_up_proj" in name
    )
    assert shapes[experts][0] == 8
    assert len(shapes[experts]) == 3


def test_greedy_generation_is_not_one_repeated_token(tiny_model):
    prompt = _random_ids(8)

    with torch.no_grad():
        output = tiny_model.generate(prompt, max_new_tokens=16, do_sample=False)

    new_tokens = output[0, prompt.shape[1] :].tolist()
    assert len(new_tokens) == 16
    assert len(set(new_tokens)) > 2


def test_routing_uses_most_experts_in_every_moe_layer(tiny_model):
    experts_hit: dict[str, set[int]] = {}

    def record(name):
        def hook(module, args, output):
            _, _, top_k_index = output  # routers return (logits, weights, indices [T, k])
            experts_hit.setdefault(name, set()).update(top_k_index.flatten().tolist())

        return hook

    routers = [(n, m) for n, m in tiny_model.named_modules() if type(m).__name__.endswith("Router")]
    handles = [module.register_forward_hook(record(name)) for name, module in routers]
    try:
        _logits(tiny_model, _random_ids(64))
    finally:
        for handle in handles:
            handle.remove()

    assert len(routers) == 2
    assert all(len(hit) >= 6 for hit in experts_hit.values()), experts_hit


def test_routing_parameters_are_not_trivial():
    deepseek_v3 = build_tiny_model("deepseek_v3")
    gpt_oss = build_tiny_model("gpt_oss")

    correction_biases = [b for n, b in deepseek_v3.named_buffers() if n.endswith("e_score_correction_bias")]
    assert len(correction_biases) == 2
    assert all(bias.abs().min() > 0 for bias in correction_biases)
    for name, param in gpt_oss.named_parameters():
        if name.endswith(("router.bias", "gate_up_proj_bias", "down_proj_bias")):
            assert param.abs().min() > 0, name


def test_arch_specific_config():
    v2, v3 = tiny_config("deepseek_v2"), tiny_config("deepseek_v3")
    assert (v2.topk_method, v2.n_group, v2.topk_group, v2.n_shared_experts) == (
        "group_limited_greedy",
        4,
        2,
        1,
    )
    assert v2.routed_scaling_factor != 1
    assert (v3.n_group, v3.topk_group, v3.norm_topk_prob, v3.routed_scaling_factor) == (4, 2, True, 2.5)
    assert v2.num_hidden_layers == 3
    assert v2.first_k_dense_replace == 1
    assert tiny_config("qwen2_moe").shared_expert_intermediate_size > 0
    assert tiny_config("qwen3_moe").norm_topk_prob
    assert tiny_config("gpt_oss").layer_types == ["sliding_attention", "full_attention"]
    assert tiny_config("gpt_oss", num_hidden_layers=4).layer_types[2:] == [
        "sliding_attention",
        "full_attention",
    ]
    for model_type in TINY_ARCHITECTURES:
        config = tiny_config(model_type)
        assert (config.hidden_size, config.vocab_size, config.num_experts_per_tok) == (64, 259, 2)
        assert not config.tie_word_embeddings


def test_overrides_reach_the_model():
    model = build_tiny_model("qwen3_moe", num_hidden_layers=3, num_experts=4)

    assert len(model.model.layers) == 3
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 2 * 32, 64)  # [E, 2I, H]


def test_unknown_model_type_and_layout_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="llama"):
        tiny_config("llama")
    with pytest.raises(ValueError, match="layout"):
        save_tiny_model(build_tiny_model("mixtral"), tmp_path, layout="interleaved")


def test_seed_reproducible_and_caller_rng_untouched():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)

    first, again, other = (
        build_tiny_model("olmoe"),
        build_tiny_model("olmoe"),
        build_tiny_model("olmoe", seed=1),
    )

    assert torch.equal(torch.rand(1), expected_next)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_save_in_half_precision(layout, dtype, tmp_path):
    model = build_tiny_model("deepseek_v3")

    folder = save_tiny_model(model, tmp_path, layout=layout, dtype=dtype)

    assert model.lm_head.weight.dtype == torch.float32
    with safe_open(folder / "model.safetensors", "pt") as weights:
        assert weights.get_tensor("lm_head.weight").dtype == dtype
    assert json.loads((folder / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    reloaded = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    )
    assert reloaded.lm_head.weight.dtype == dtype
    input_ids = _random_ids(16)
    expected = _logits(build_tiny_model("deepseek_v3", dtype=dtype), input_ids)
    torch.testing.assert_close(_logits(reloaded, input_ids), expected, atol=0, rtol=0)


def test_tokenizer_round_trips_multibyte_text(tmp_path):
    text = "héllo 🌍 世界"
    tiny_tokenizer().save_pretrained(tmp_path)

    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    token_ids = tokenizer.encode(text)

    assert tokenizer.decode(token_ids) == text
    assert len(token_ids) == len(text.encode("utf-8"))  # one token per byte, no merges
    assert max(token_ids) < 256
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert len(tokenizer) == tiny_config("qwen3_moe").vocab_size


def test_chat_template_renders_generation_prompt():
    tokenizer = tiny_tokenizer()
    messages = [{"role": "user", "content": "hi 🌍"}]

    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)

    assert prompt == "<|im_start|>user\nhi 🌍<|im_end|>\n<|im_start|>assistant\n"
    assert without_prompt == "<|im_start|>user\nhi 🌍<|im_end|>\n"
    assert tokenizer.decode(tokenizer.encode(prompt)) == prompt


def test_make_tiny_model_writes_a_loadable_folder(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", "granitemoe", seed=3, layout="fused")

    tokenizer = AutoTokenizer.from_pretrained(folder)
    generation_config = GenerationConfig.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")

    assert generation_config.eos_token_id == tokenizer.eos_token_id == model.config.eos_token_id
    assert model.config.model_type == "granitemoe"
    expected = _logits(build_tiny_model("granitemoe", seed=3), _random_ids(8))
    torch.testing.assert_close(_logits(model, _random_ids(8)), expected, atol=1e-5, rtol=0)
