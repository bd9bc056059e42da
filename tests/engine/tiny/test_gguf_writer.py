"""engine.tiny.gguf_writer: tiny MoE GGUF files laid out as llama.cpp writes them, which transformers'
own GGUF loader reads back to the very weights the file holds."""

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.tiny.gguf_writer import (
    demo_tokenizer,
    dequantized_model,
    dequantized_state_dict,
    gguf_config,
    gguf_metadata,
    quantize,
    tiny_gguf_overrides,
    write_split_gguf,
    write_tiny_gguf,
)
from engine.tiny.models import build_tiny_model

VOCAB, HIDDEN, EXPERT_WIDTH, EXPERTS, LAYERS = 1350, 256, 512, 8, 2


@pytest.fixture(scope="module")
def qwen3_file(tmp_path_factory):
    """The default file (Q4_K gate/up, Q6_K down, F32 elsewhere) with a safetensors copy beside it."""
    root = tmp_path_factory.mktemp("qwen3")
    return write_tiny_gguf(root / "gguf", safetensors_dir=root / "safetensors")


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("qwen2"), "qwen2_moe", other_type=QT.Q8_0)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids()).logits


def _transformers_gguf(path, config=None):
    """transformers' own GGUF loading (its legacy path: qwen2moe/qwen3moe have no fast one in 5.23)."""
    config = config if config is not None else gguf_config(path)
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32
    )


@pytest.mark.parametrize(("qtype", "bound"), [(QT.Q4_K, 0.09), (QT.Q5_K, 0.045), (QT.Q6_K, 0.025)])
def test_k_quant_blocks_decode_with_gguf_py_to_the_input(qtype, bound):
    rows = np.random.default_rng(0).standard_normal((3, 4, 512)).astype(np.float32) * 0.1
    rows[0, 0] = 0.0
    rows[0, 1] = np.abs(rows[0, 1]) + 0.05  # all positive: Q4_K's min clamps to zero
    blocks = quantize(rows, qtype)
    assert blocks.dtype == np.uint8
    assert blocks.shape == gguf.quant_shape_to_byte_shape(rows.shape, qtype)
    back = gguf.quants.dequantize(blocks, qtype)
    assert back.shape == rows.shape
    assert np.all(back[0, 0] == 0.0)
    assert np.sqrt(np.mean((back - rows) ** 2) / np.mean(rows**2)) < bound
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(rows[..., :100], qtype)


def test_the_file_has_llama_cpp_keys_tensor_names_shapes_and_types(qwen3_file):
    metadata = gguf_metadata(qwen3_file)
    assert {
        "general.architecture": "qwen3moe",
        "general.file_type": gguf.LlamaFileType.MOSTLY_Q4_K_M,
        "qwen3moe.block_count": LAYERS,
        "qwen3moe.embedding_length": HIDDEN,
        "qwen3moe.attention.head_count": 4,
        "qwen3moe.attention.head_count_kv": 2,
        "qwen3moe.attention.key_length": 64,
        "qwen3moe.expert_count": EXPERTS,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_feed_forward_length": EXPERT_WIDTH,
        "qwen3moe.rope.freq_base": 1_000_000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.eos_token_id": 2,
    }.items() <= metadata.items()
    assert len(metadata["tokenizer.ggml.tokens"]) == VOCAB
    tensors = {t.name: t for t in GGUFReader(qwen3_file).tensors}
    per_layer = "attn_norm attn_q attn_k attn_v attn_output attn_q_norm attn_k_norm ffn_norm ffn_gate_inp"
    per_layer += " ffn_gate_exps ffn_up_exps ffn_down_exps"
    expected = {"token_embd", "output_norm", "output"}
    expected |= {f"blk.{i}.{name}" for i in range(LAYERS) for name in per_layer.split()}
    assert set(tensors) == {f"{name}.weight" for name in expected}
    shapes = {name: (tuple(int(n) for n in t.shape), t.tensor_type) for name, t in tensors.items()}
    # GGUF lists ne, fastest axis first: [H, I, E] is numpy/torch's [E, I, H]
    assert shapes["blk.1.ffn_gate_exps.weight"] == ((HIDDEN, EXPERT_WIDTH, EXPERTS), QT.Q4_K)
    assert shapes["blk.1.ffn_up_exps.weight"] == ((HIDDEN, EXPERT_WIDTH, EXPERTS), QT.Q4_K)
    assert shapes["blk.1.ffn_down_exps.weight"] == ((EXPERT_WIDTH, HIDDEN, EXPERTS), QT.Q6_K)
    assert shapes["blk.1.ffn_gate_inp.weight"] == ((HIDDEN, EXPERTS), QT.F32)
    assert shapes["blk.1.attn_k.weight"] == ((HIDDEN, 128), QT.F32)
    assert shapes["blk.1.attn_q_norm.weight"] == ((64,), QT.F32)


def test_qwen2_moe_writes_its_shared_expert_and_quantizes_the_other_matrices(qwen2_file):
    metadata = gguf_metadata(qwen2_file)
    assert metadata["qwen2moe.expert_shared_feed_forward_length"] == 512
    assert "qwen2moe.attention.key_length" not in metadata  # its config.json states no head_dim
    types = {t.name: (tuple(int(n) for n in t.shape), t.tensor_type) for t in GGUFReader(qwen2_file).tensors}
    assert types["blk.0.ffn_gate_inp_shexp.weight"] == ((HIDDEN,), QT.F32)
    assert types["blk.0.ffn_down_shexp.weight"] == ((512, HIDDEN), QT.Q8_0)
    assert types["blk.0.attn_q.bias"] == ((HIDDEN,), QT.F32)
    assert types["token_embd.weight"] == ((HIDDEN, VOCAB), QT.Q8_0)
    assert types["blk.0.ffn_gate_inp.weight"][1] == QT.F32  # the router stays F32, as llama.cpp keeps it


def test_transformers_reads_the_dims_but_not_the_expert_width(qwen3_file, qwen2_file):
    source = build_tiny_model("qwen3_moe", **tiny_gguf_overrides("qwen3_moe", demo_tokenizer())).config
    raw = AutoConfig.from_pretrained(qwen3_file.parent, gguf_file=qwen3_file.name)
    dims = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    dims += ("num_experts", "num_experts_per_tok", "vocab_size", "max_position_embeddings", "eos_token_id")
    dims += ("tie_word_embeddings", "norm_topk_prob", "rope_parameters")
    assert {d: getattr(raw, d) for d in dims} == {d: getattr(source, d) for d in dims}
    assert raw.rms_norm_eps == pytest.approx(source.rms_norm_eps)  # stored as f32 in the file
    # transformers 5.23's GGUF config mapping has no entry for {arch}.expert_feed_forward_length (nor
    # qwen2moe's expert_shared_feed_forward_length): the widths fall back to the class defaults. If this
    # fails, transformers fixed it and gguf_config's correction is a no-op.
    assert raw.moe_intermediate_size == 768
    assert gguf_config(qwen3_file).moe_intermediate_size == EXPERT_WIDTH
    raw2 = AutoConfig.from_pretrained(qwen2_file.parent, gguf_file=qwen2_file.name)
    assert (raw2.moe_intermediate_size, raw2.shared_expert_intermediate_size) == (1408, 5632)
    fixed2 = gguf_config(qwen2_file)
    assert (fixed2.moe_intermediate_size, fixed2.shared_expert_intermediate_size) == (EXPERT_WIDTH, 512)


def test_without_the_true_config_transformers_refuses_the_expert_tensors(qwen3_file):
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(
            qwen3_file.parent, gguf_file=qwen3_file.name, dtype=torch.float32
        )


@pytest.mark.parametrize("file", ["qwen3_file", "qwen2_file"])
def test_transformers_logits_equal_those_of_the_dequantized_weights(file, request):
    path = request.getfixturevalue(file)
    torch.testing.assert_close(
        _logits(_transformers_gguf(path)), _logits(dequantized_model(path)), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("qwen3_moe", {}), ("qwen2_moe", {}), ("qwen3_moe", {"tie_word_embeddings": True})],
)
def test_an_unquantized_file_gives_the_source_models_logits(tmp_path, model_type, overrides):
    path = write_tiny_gguf(
        tmp_path, model_type, expert_type=QT.F32, down_type=QT.F32, other_type=QT.F32, seed=3, **overrides
    )
    assert ("output.weight" in {t.name for t in GGUFReader(path).tensors}) != bool(overrides)
    source = build_tiny_model(
        model_type, seed=3, **tiny_gguf_overrides(model_type, demo_tokenizer()), **overrides
    )
    torch.testing.assert_close(_logits(_transformers_gguf(path)), _logits(source), atol=1e-4, rtol=0)


def test_the_safetensors_beside_the_file_hold_the_same_weights(qwen3_file, tmp_path):
    with pytest.raises(ValueError, match="outside the GGUF's folder"):
        write_tiny_gguf(tmp_path, safetensors_dir=tmp_path)
    folder = qwen3_file.parent.parent / "safetensors"
    safetensors = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.testing.assert_close(
        _logits(safetensors), _logits(_transformers_gguf(qwen3_file)), atol=1e-4, rtol=0
    )


def test_the_tokenizer_from_the_file_encodes_like_the_source(qwen3_file):
    from_file = AutoTokenizer.from_pretrained(qwen3_file.parent, gguf_file=qwen3_file.name)
    source = demo_tokenizer()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello, world!  It's 2024: naïve café ✓ 12345\n\tdon't DON'T"},
    ]

    def chat_ids(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]

    assert chat_ids(from_file) == chat_ids(source)
    # " 123": GPT-2's split keeps the space with the digits; Qwen2's ("qwen2" pre) would not
    for text in (" 123 45", "a  b   c\n\n", "<|im_start|>user\nhi<|im_end|>"):
        assert from_file.encode(text) == source.encode(text)
    assert (from_file.eos_token, from_file.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert from_file.chat_template == source.chat_template


def test_a_split_set_holds_the_file_in_parts(qwen3_file, tmp_path):
    single = tmp_path / qwen3_file.name
    shutil.copy(qwen3_file, single)
    shards = write_split_gguf(single, 3)
    assert [s.name for s in shards] == [f"{single.stem}-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]
    readers = [GGUFReader(s) for s in shards]
    assert [r.fields["split.no"].contents() for r in readers] == [0, 1, 2]
    assert all(r.fields["split.count"].contents() == 3 for r in readers)
    names = [t.name for r in readers for t in r.tensors]
    assert names == [t.name for t in GGUFReader(single).tensors]
    assert all(len(r.tensors) for r in readers)
    assert gguf_metadata(shards[1])["tokenizer.ggml.tokens"] == gguf_metadata(single)["tokenizer.ggml.tokens"]
    model = dequantized_model(shards[0])  # config from the first shard, tensors from all three
    for name, tensor in dequantized_state_dict(single, model).items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_q4_k_m_gives_half_of_a_models_down_projections_q6_k_as_llama_cpp_does():
    from engine.tiny.gguf_writer import q4_k_m_down_type

    types = [q4_k_m_down_type(layer, 48) for layer in range(48)]  # Qwen3-30B-A3B's 48 layers
    more = [layer for layer, t in enumerate(types) if t == QT.Q6_K]
    assert more[:8] == [0, 1, 2, 3, 4, 5, 8, 11] and more[-6:] == [42, 43, 44, 45, 46, 47]
    assert len(more) == 24 and set(types) == {QT.Q4_K, QT.Q6_K}
    assert [q4_k_m_down_type(layer, 2) for layer in range(2)] == [QT.Q4_K, QT.Q6_K]
