"""Tiny random Mixture-of-Experts models as GGUF files, laid out the way llama.cpp's converter writes them.

Contract: `write_tiny_gguf(folder, model_type)` builds engine.tiny.models's model with rows K-quants can
block (256 wide), writes `folder/tiny-<model_type>-<expert type>.gguf` with the bundled demo model's
tokenizer and returns its path (`safetensors_dir=` also saves the same weights, dequantized, as a hub
checkpoint). `gguf_config` is transformers' config for a file with its misreadings put right;
`dequantized_state_dict`/`dequantized_model` read a file back under transformers' in-memory names;
`write_split_gguf` re-writes a file as a `-0000k-of-0000N.gguf` set. Architectures: qwen3_moe
("qwen3moe") and qwen2_moe ("qwen2moe"), as convert_hf_to_gguf.py's Qwen2MoeModel/Qwen3MoeModel write:
- keys: general.{architecture,type,name,file_type,quantization_version}; {arch}.block_count,
  context_length, embedding_length, feed_forward_length, attention.head_count(_kv), rope.freq_base,
  attention.layer_norm_rms_epsilon, expert_count, expert_used_count, expert_feed_forward_length,
  attention.key_length/value_length (where config.json states head_dim), qwen2moe's
  expert_shared_feed_forward_length; tokenizer.ggml.{model "gpt2", pre, tokens, token_type, merges,
  eos/padding/bos (where set) _token_id, add_bos_token}, tokenizer.chat_template.
- tensors (numpy shapes, GGUF's ne reversed): token_embd [V, H], blk.N.{attn_norm, attn_q [nh*hd, H],
  attn_k/attn_v [kv*hd, H] (+ .bias: qwen2moe), attn_q_norm/attn_k_norm [hd] (qwen3moe), attn_output,
  ffn_norm, ffn_gate_inp [E, H] (router), ffn_gate_exps/ffn_up_exps [E, I, H] (transformers' fused
  gate_up_proj cut in two), ffn_down_exps [E, H, I]}, qwen2moe's ffn_{gate,up,down}_shexp and
  ffn_gate_inp_shexp [H] (HF's [1, H] squeezed), output_norm, output [V, H] (absent when tied).
- types: routed gate/up `expert_type`, down `down_type` (or `Q4_K_M_DOWN`: llama.cpp's per-layer
  rule); 1-D tensors and the router F32 (the converter and llama-quantize keep ffn_gate_inp F32);
  every other matrix `other_type`.
- no Q/K permutation: the converter permutes attn_q/attn_k only for llama-arch models, and
  transformers' TensorProcessor for qwen2moe/qwen3moe undoes none.
K-quant blocks come from engine.tiny.kquant_encode (gguf-py cannot quantize K-quants).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from engine.resources import demo_model_dir
from engine.tiny.kquant_encode import quantize
from engine.tiny.models import build_tiny_model, save_tiny_model

QT = GGMLQuantizationType
GGUF_ARCHITECTURES = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE}
# tokenizer.ggml.pre: the demo tokenizer splits with GPT-2's ByteLevel regex, llama.cpp's "gpt-2".
PRE_TOKENIZER = "gpt-2"
_SHARD = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _gguf_names(hf_name: str, names: gguf.TensorNameMap) -> list[str]:
    """The GGUF tensor(s) holding transformers' `hf_name`: two for the fused gate_up_proj."""
    if hf_name.endswith(".mlp.experts.gate_up_proj"):
        stem = hf_name.removesuffix("gate_up_proj")
        return [f"{names.get_name(stem + 'gate_proj')}.weight", f"{names.get_name(stem + 'up_proj')}.weight"]
    stem, suffix = hf_name, ".weight"
    if hf_name.endswith((".weight", ".bias")):
        stem, dot, suffix = hf_name.rpartition(".")
        suffix = dot + suffix
    if (gguf_name := names.get_name(stem)) is None:
        raise KeyError(f"llama.cpp has no tensor name for {hf_name}")
    return [gguf_name + suffix]


def _name_map(config: PretrainedConfig) -> gguf.TensorNameMap:
    if config.model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"no GGUF layout for {config.model_type!r}; known: {', '.join(GGUF_ARCHITECTURES)}")
    return gguf.get_tensor_name_map(GGUF_ARCHITECTURES[config.model_type], config.num_hidden_layers)


Q4_K_M_DOWN = "Q4_K_M"  # as `down_type`: llama.cpp's Q4_K_M rule, Q6_K in its use_more_bits layers


def q4_k_m_down_type(layer: int, num_layers: int) -> QT:
    """The type llama.cpp's Q4_K_M gives `layer`'s down projection (llama-quant.cpp's
    use_more_bits: the first and last eighth of the layers and every third between: Q6_K)."""
    eighth = num_layers // 8
    more = layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2
    return QT.Q6_K if more else QT.Q4_K


def _tensor_type(name: str, data: np.ndarray, expert: QT, down: QT | str, other: QT, layers: int) -> QT:
    if data.ndim == 1 or ".ffn_gate_inp." in name:
        return QT.F32
    if "_exps." in name and ".ffn_down_exps." in name and down == Q4_K_M_DOWN:
        return q4_k_m_down_type(int(name.split(".")[1]), layers)
    if "_exps." in name:
        return down if ".ffn_down_exps." in name else expert
    return other


def gguf_tensors(
    model: PreTrainedModel, expert: QT, down: QT | str, other: QT
) -> list[tuple[str, np.ndarray, QT]]:
    """(GGUF name, quantized data, type) for every weight of `model`, in state_dict order."""
    names, tied = _name_map(model.config), model.config.tie_word_embeddings
    out = []
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp writes no output.weight for a tied head
        gguf_names = _gguf_names(hf_name, names)
        data = tensor.detach().to(torch.float32).numpy()
        if len(gguf_names) == 2:  # gate_up_proj [E, 2I, H]: gate rows first, then up
            pieces = np.split(data, 2, axis=1)
        elif gguf_names[0].endswith(".ffn_gate_inp_shexp.weight"):
            pieces = [data.reshape(-1)]  # HF [1, H]; llama.cpp and transformers' loader expect [H]
        else:
            pieces = [data]
        for name, piece in zip(gguf_names, pieces, strict=True):
            qtype = _tensor_type(name, piece, expert, down, other, model.config.num_hidden_layers)
            out.append((name, quantize(piece, qtype), qtype))
    return out


def _add_model_metadata(writer: GGUFWriter, config: PretrainedConfig, name: str) -> None:
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        raise ValueError("llama.cpp's qwen MoE layout has no dense layers (mlp_only_layers)")
    writer.add_type("model")
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if (shared := getattr(config, "shared_expert_intermediate_size", None)) is not None:
        writer.add_expert_shared_feed_forward_length(shared)
    if (head_dim := config.to_dict().get("head_dim")) is not None:  # as in config.json, not derived
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _add_tokenizer_metadata(writer: GGUFWriter, tokenizer: Any, vocab_size: int) -> None:
    """The vocabulary as llama.cpp's `_set_vocab_gpt2` writes it: every id up to the model's vocab
    size, added special tokens as CONTROL, other added ones USER_DEFINED, gaps as [PADn] UNUSED."""
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if (token := added.get(index)) is not None:
            tokens.append(token.content)
            types.append(gguf.TokenType.CONTROL if token.special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id.get(index, f"[PAD{index}]"))
            types.append(gguf.TokenType.NORMAL if index in by_id else gguf.TokenType.UNUSED)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "padding": tokenizer.pad_token_id}
    for key, token_id in ids.items():
        if token_id is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _write(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_model_gguf(
    model: PreTrainedModel,
    tokenizer: Any,
    path: str | Path,
    *,
    expert_type: QT = QT.Q4_K,
    down_type: QT | str = QT.Q6_K,
    other_type: QT = QT.F32,
) -> Path:
    """Write a qwen3_moe/qwen2_moe `model` and `tokenizer` as one GGUF file at `path`."""
    path = Path(path)
    config = model.config
    writer = GGUFWriter(path, gguf.MODEL_ARCH_NAMES[GGUF_ARCHITECTURES[config.model_type]])
    _add_model_metadata(writer, config, path.stem)
    known = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}
    file_type = gguf.LlamaFileType.__members__.get(known.get(expert_type.name, f"MOSTLY_{expert_type.name}"))
    if file_type is not None:  # ALL_F32 is 0
        writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer_metadata(writer, tokenizer, config.vocab_size)
    for name, data, qtype in gguf_tensors(model, expert_type, down_type, other_type):
        writer.add_tensor(name, data, raw_dtype=qtype)
    _write(writer)
    return path


def demo_tokenizer() -> Any:
    """The bundled demo model's byte-level BPE tokenizer (1350 tokens, ChatML template)."""
    return AutoTokenizer.from_pretrained(demo_model_dir())


def tiny_gguf_overrides(model_type: str, tokenizer: Any) -> dict[str, Any]:
    """engine.tiny.models overrides giving rows K-quants can block (256 wide) and `tokenizer`'s ids."""
    overrides = {
        "hidden_size": 256,
        "intermediate_size": 256,
        "moe_intermediate_size": 512,  # unlike hidden_size, so a transposed expert shows in its shape
        "num_attention_heads": 4,  # 4 heads x 64 = 256: attn_output's rows block too
        "num_key_value_heads": 2,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        # not the config class's default, so a loader that drops rope.freq_base changes the logits
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }
    if model_type == "qwen3_moe":
        overrides["head_dim"] = 64
    if model_type == "qwen2_moe":
        overrides["shared_expert_intermediate_size"] = 512
    return overrides


def write_tiny_gguf(
    folder: str | Path,
    model_type: str = "qwen3_moe",
    *,
    expert_type: QT = QT.Q4_K,
    down_type: QT | str = QT.Q6_K,
    other_type: QT = QT.F32,
    seed: int = 0,
    safetensors_dir: str | Path | None = None,
    safetensors_dtype: torch.dtype | None = None,
    **config_overrides,
) -> Path:
    """Build a tiny `model_type` model and write it as `folder/tiny-<model_type>-<expert_type>.gguf`.

    `safetensors_dir`: also save the file's weights (dequantized, fp32 or `safetensors_dtype`) there
    as a hub checkpoint. Not in
    `folder`: beside a tokenizer_config.json, transformers 5.23's `AutoTokenizer.from_pretrained(folder,
    gguf_file=...)` takes the class named there (TokenizersBackend) and drops the GGUF's chat template.
    """
    folder = Path(folder)
    if safetensors_dir is not None and Path(safetensors_dir).resolve() == folder.resolve():
        raise ValueError("save the safetensors checkpoint outside the GGUF's folder (see the docstring)")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = demo_tokenizer()
    overrides = {**tiny_gguf_overrides(model_type, tokenizer), **config_overrides}
    model = build_tiny_model(model_type, seed=seed, **overrides)
    path = folder / f"tiny-{model_type}-{expert_type.name}.gguf"
    write_model_gguf(
        model, tokenizer, path, expert_type=expert_type, down_type=down_type, other_type=other_type
    )
    if safetensors_dir is not None:
        model.load_state_dict(dequantized_state_dict(path, model))
        save_tiny_model(model, safetensors_dir, dtype=safetensors_dtype, tokenizer=tokenizer)
    return path


def gguf_files(path: str | Path) -> list[Path]:
    """`path`, or every shard of the split set `path` is one of."""
    path = Path(path)
    if not (m := _SHARD.match(path.name)):
        return [path]
    count = int(m["count"])
    return [path.with_name(f"{m['stem']}-{k:05d}-of-{count:05d}.gguf") for k in range(1, count + 1)]


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every key of the file (of the first shard of a split set) with its value."""
    reader = GGUFReader(gguf_files(path)[0])
    return {name: field.contents() for name, field in reader.fields.items()}


def gguf_config(path: str | Path) -> PretrainedConfig:
    """transformers' config for the GGUF at `path`, with what transformers 5.23 misreads put right.

    Its legacy GGUF mapping (integrations/ggml.py, GGUF_CONFIG_MAPPING) has no entry for
    {arch}.expert_feed_forward_length nor {arch}.expert_shared_feed_forward_length, so
    `moe_intermediate_size` and `shared_expert_intermediate_size` keep the config class's defaults
    (Qwen3Moe 768; Qwen2Moe 1408 and 5632); they are taken from the file here. And it reads only one
    file of a split set, so it would tie the head of any set whose output.weight is not in the first.
    """
    files = gguf_files(path)
    config = AutoConfig.from_pretrained(files[0].parent, gguf_file=files[0].name)
    metadata = gguf_metadata(files[0])
    # transformers ties the head when the file it reads has no output.weight: a split set's first shard
    config.tie_word_embeddings = not any(
        t.name == "output.weight" for f in files for t in GGUFReader(f).tensors
    )
    arch = metadata["general.architecture"]
    for attribute, key in (
        ("moe_intermediate_size", "expert_feed_forward_length"),
        ("shared_expert_intermediate_size", "expert_shared_feed_forward_length"),
    ):
        if f"{arch}.{key}" in metadata:
            setattr(config, attribute, int(metadata[f"{arch}.{key}"]))
    return config


def dequantized_state_dict(path: str | Path, model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The file's tensors dequantized to fp32 under `model`'s state_dict names and shapes."""
    tensors = {t.name: t for file in gguf_files(path) for t in GGUFReader(file).tensors}
    names = _name_map(model.config)
    state = {}
    for hf_name, param in model.state_dict().items():
        gguf_names = _gguf_names(hf_name, names)
        if model.config.tie_word_embeddings and hf_name == "lm_head.weight":
            gguf_names = ["token_embd.weight"]
        missing = [name for name in gguf_names if name not in tensors]
        if missing:
            raise KeyError(f"{path} has no {', '.join(missing)} (for {hf_name})")
        parts = [gguf.quants.dequantize(tensors[n].data, tensors[n].tensor_type) for n in gguf_names]
        data = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        state[hf_name] = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(param.shape)
    return state


def dequantized_model(path: str | Path, config: PretrainedConfig | None = None) -> PreTrainedModel:
    """A fp32 model built from `config` (default `gguf_config(path)`) holding the file's weights."""
    config = config if config is not None else gguf_config(path)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    with torch.random.fork_rng(devices=[]):  # from_config draws random weights we then overwrite
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dequantized_state_dict(path, model))
    return model.eval()


def write_split_gguf(path: str | Path, parts: int) -> list[Path]:
    """Re-write the GGUF at `path` as `parts` files `<stem>-0000k-of-0000N.gguf` beside it, as
    llama.cpp's gguf-split does: all metadata in the first, split.{no,count,tensors.count} in each,
    tensors shared out in order. Returns the shard paths."""
    path = Path(path)
    reader = GGUFReader(path)
    if not 1 < parts <= len(reader.tensors):
        raise ValueError(f"cannot split {len(reader.tensors)} tensors into {parts} files")
    writer = GGUFWriter(path, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    starts = {int(chunk[0]) for chunk in np.array_split(np.arange(len(reader.tensors)), parts)}
    for index, tensor in enumerate(reader.tensors):
        if index in starts and index:
            writer.tensors.append({})  # GGUFWriter starts a new shard at each new dict
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    _write(writer)
    return writer.format_shard_names(path)
