"""Tiny random Mixture-of-Experts checkpoints for tests and the CLI smoke test.

Contract: `make_tiny_model(dir, model_type)` writes a folder that loads with
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` like a hub
checkpoint: config.json, generation_config.json, safetensors (one file or shards plus
model.safetensors.index.json) and a byte-level ChatML tokenizer. Every supported architecture
is covered (the hand-tuned `TINY_ARCHITECTURES` here, every other one shrunk generically by
engine.tiny.registry), seeded, fp32 by default, with eager attention and eager experts.

Two on-disk layouts:
- "per_expert": transformers' own `save_pretrained`, which undoes its load-time conversions
  (transformers/conversion_mapping.py). What 5.23 writes for an MoE layer:
    qwen3_moe, qwen2_moe, olmoe, deepseek_v2/v3: mlp.experts.{e}.{gate,up,down}_proj.weight,
      router mlp.gate.weight (+ deepseek_v3's mlp.gate.e_score_correction_bias, qwen2_moe's
      mlp.shared_expert.* and mlp.shared_expert_gate.weight, deepseek's mlp.shared_experts.*).
    mixtral, phimoe: block_sparse_moe.experts.{e}.w{1,3,2}.weight (gate, up, down) and router
      block_sparse_moe.gate.weight; in memory both are mlp.*, phimoe's router is mlp.router.
    granitemoe: 3D tensors under legacy names, block_sparse_moe.input_linear.weight [E, 2I, H],
      output_linear.weight [E, H, I], router.layer.weight (in memory: block_sparse_moe.experts.*
      and block_sparse_moe.router.weight).
    gpt_oss: no conversion, the in-memory names: mlp.experts.gate_up_proj [E, H, 2I] with gate/up
      interleaved, gate_up_proj_bias, down_proj [E, I, H], down_proj_bias, mlp.router.{weight,bias}.
- "fused": the model's own state_dict names (e.g. mlp.experts.gate_up_proj [E, 2I, H] and
  mlp.experts.down_proj [E, H, I]) written with safetensors directly.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.utils.hub import convert_file_size_to_int

from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.tiny.registry import is_multimodal, shrunk_config

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Shared by every architecture; head_dim is set where the config would otherwise default to 128.
_COMMON = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 32,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    # 0.02 gives near-uniform logits and routing; 0.1 gives varied greedy text and busy routers.
    "initializer_range": 0.1,
}
_MLA = {  # DeepSeek multi-head latent attention; it has no GQA, so one KV head per query head.
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "intermediate_size": 48,  # the dense first layer
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
_ARCH_SETTINGS: dict[str, dict] = {
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 32, "head_dim": 16, "norm_topk_prob": True},
    "qwen2_moe": {"num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
    "mixtral": {"num_local_experts": 8},
    "olmoe": {"num_experts": 8},
    "deepseek_v2": {
        **_MLA,
        "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 1.5,
    },
    "deepseek_v3": {**_MLA, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
    "gpt_oss": {
        "num_local_experts": 8,
        "head_dim": 16,
        "sliding_window": 8,
        "swiglu_limit": 7.0,
        # YaRN as in the real model, with original/extended context matching the tiny 512 window.
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
    },
    "phimoe": {"num_local_experts": 8, "attention_bias": True, "lm_head_bias": True},
    "granitemoe": {
        "num_local_experts": 8,
        "embedding_multiplier": 4.0,
        "attention_multiplier": 0.125,
        "residual_multiplier": 0.5,
        "logits_scaling": 2.0,
    },
}


# The hand-tuned families every feature test runs over (layouts, routers, attention kinds of the
# original adapters); every supported family is checked exact in tests/engine/model/test_all_families.py.
TINY_ARCHITECTURES: tuple[str, ...] = tuple(_ARCH_SETTINGS)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that the ByteLevel pre-tokenizer uses."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: token id == byte value for ids 0-255, then the three ChatML specials."""
    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def tiny_config(model_type: str, **overrides) -> PretrainedConfig:
    """A 64-wide, 8-expert, top-2 config of `model_type`; `overrides` win over every default.

    The hand-tuned families (`TINY_ARCHITECTURES`) have settings here; every other supported
    family is shrunk generically from its config class (engine.tiny.registry)."""
    if model_type not in _ARCH_SETTINGS:
        if model_type in SUPPORTED_MODEL_TYPES:
            return shrunk_config(model_type, **overrides)
        raise ValueError(
            f"no tiny config for model_type {model_type!r}; known: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    special_ids = {token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}
    settings = {
        **_COMMON,
        "vocab_size": 256 + len(SPECIAL_TOKENS),
        "bos_token_id": None,
        "eos_token_id": special_ids["<|im_end|>"],
        "pad_token_id": special_ids["<|endoftext|>"],
        **_ARCH_SETTINGS[model_type],
        **overrides,
    }
    # Passed to the constructor, not set afterwards, so derived fields (gpt-oss layer_types,
    # DeepSeek qk_head_dim) follow overridden layer counts and sizes.
    config = AutoConfig.for_model(model_type, **settings)
    config._attn_implementation = "eager"  # deterministic on CPU, and supports gpt-oss sinks
    config._experts_implementation = "eager"
    return config


def _make_weights_telling(model: PreTrainedModel, std: float) -> None:
    """Make the random weights catch loader and routing bugs.

    Tensors initialised to a constant (norm weights, biases, DeepSeek-V3's e_score_correction_bias)
    get noise, so dropping, swapping or zeroing one changes the logits. Token embeddings get std 1:
    at initializer_range scale the random layers' shared component swamps each token's identity and
    the second MoE layer routes nearly every token to the same two or three experts.
    """
    tensors = dict(model.named_parameters())
    tensors.update((name, b) for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1.0 / std)
        for name, tensor in tensors.items():
            if tensor.numel() > 1 and torch.all(tensor == tensor.flatten()[0]):
                logger.debug("perturbing constant tensor %s", name)
                tensor.add_(torch.randn_like(tensor) * std)


def published_tiny_model(
    model_type: str, seed: int = 0, telling: bool = False, **overrides
) -> PreTrainedModel:
    """A random tiny `model_type` model (`tiny_config`), reproducible from `seed`, in the class its
    checkpoints are published as: a vision-language family's as that, whose saved folder
    transformers' causal-LM class reads back as its language model. `telling`: weights that catch
    loader and routing bugs (`_make_weights_telling`); else as the class draws them."""
    config = tiny_config(model_type, **overrides)
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG stream alone
        torch.manual_seed(seed)
        model = _published(model_type).from_config(config, dtype=torch.float32)
        if telling:
            _make_weights_telling(model, std=config.get_text_config().initializer_range)
    return model.eval()


def build_tiny_model(
    model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides
) -> PreTrainedModel:
    """Random tiny model of `model_type` in eval mode with telling weights, reproducible from `seed`."""
    model = published_tiny_model(model_type, seed, telling=True, **overrides)
    # Drawn in fp32 and then cast, so one seed gives the same weights in every dtype.
    return _with_dtype(model, dtype)


def _published(model_type: str) -> type:
    return AutoModelForImageTextToText if is_multimodal(model_type) else AutoModelForCausalLM


def _with_dtype(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """`model` with its weights in `dtype`, as from_pretrained would give it; the original is untouched.

    Not `model.to(dtype)`: that also casts the RoPE inv_freq buffer, which from_pretrained keeps in fp32.
    """
    if model.dtype == dtype:
        return model
    with torch.random.fork_rng(devices=[]):  # from_config draws random weights we then overwrite
        cast = _published(model.config.model_type).from_config(copy.deepcopy(model.config), dtype=dtype)
    cast.load_state_dict(model.state_dict())
    return cast.eval()


def _shard_state_dict(
    state_dict: dict[str, torch.Tensor], max_shard_size: str | None
) -> list[dict[str, torch.Tensor]]:
    """Greedy split in key order; a tensor larger than the limit gets a shard of its own."""
    if max_shard_size is None:
        return [state_dict]
    limit = convert_file_size_to_int(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > limit:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    return shards


def _save_fused(model: PreTrainedModel, out_dir: Path, max_shard_size: str | None) -> None:
    """Write the in-memory state_dict names (fused 3D experts) plus config.json."""
    state_dict = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    shards = _shard_state_dict(state_dict, max_shard_size)
    if len(shards) == 1:
        save_file(shards[0], out_dir / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for index, shard in enumerate(shards, start=1):
            file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out_dir / file_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file_name))
        total_size = sum(t.numel() * t.element_size() for t in state_dict.values())
        index_json = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    model.config.save_pretrained(out_dir)


def save_tiny_model(
    model: PreTrainedModel,
    out_dir: str | Path,
    layout: str = "per_expert",
    max_shard_size: str | None = None,
    dtype: torch.dtype | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Save `model` as a hub-style folder in `layout` ("per_expert" or "fused"); returns the folder."""
    if layout not in ("per_expert", "fused"):
        raise ValueError(f"layout must be 'per_expert' or 'fused', not {layout!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        model = _with_dtype(model, dtype)
    if layout == "per_expert":
        model.save_pretrained(out_dir, max_shard_size=max_shard_size or "50GB")
    else:
        _save_fused(model, out_dir, max_shard_size)
    tokenizer = tokenizer or tiny_tokenizer()
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out_dir)
    logger.info("saved tiny %s (%s layout) to %s", model.config.model_type, layout, out_dir)
    return out_dir


def make_tiny_model(
    out_dir: str | Path, model_type: str = "qwen3_moe", seed: int = 0, layout: str = "per_expert", **overrides
) -> Path:
    """Build a tiny `model_type` model and save it to `out_dir` in `layout`; returns the folder."""
    model = build_tiny_model(model_type, seed=seed, **overrides)
    return save_tiny_model(model, out_dir, layout=layout)
