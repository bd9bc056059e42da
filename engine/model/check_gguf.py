"""Is this GGUF file (or split set) a model MoE Chat can load? Its header only (no tensor data).

`check_gguf(parts)` is `engine.model.check.check_model_folder` for GGUF files: the architecture,
experts and tensors, the name the file gives itself (`general.name` and its quant type, as the
library lists an imported file) and the bytes the loader will hold.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.model.model_check import FLOAT_DTYPES, ModelCheck

GGUF_EXPERTS = re.compile(r"\.ffn_(gate|up|down|gate_up)_exps\.")  # llama.cpp's routed experts
SPLIT_SUFFIX = re.compile(r"-\d{5}-of-\d{5}$")  # a split set's part number, left out of its name

GGUF_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "gpt-oss": "gpt_oss"}


def check_gguf(parts: list[Path]) -> ModelCheck:
    """A GGUF file's header: its architecture, experts and tensors (the data is not read)."""
    from gguf import GGUFReader

    tensors, fields = [], {}
    for part in parts:
        try:
            reader = GGUFReader(part)
        except (ValueError, OSError, IndexError, KeyError) as err:
            problem = (
                f"{part} is not a readable GGUF file ({err}). It is truncated or corrupt: download it again."
            )
            return ModelCheck(str(parts[0]), (problem,))
        tensors += reader.tensors
        fields = fields or {name: field.contents() for name, field in reader.fields.items()}
    arch = fields.get("general.architecture")
    model_type = GGUF_MODEL_TYPES.get(arch)
    problems = []
    if model_type is None or model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(sorted(GGUF_MODEL_TYPES))
        problems.append(
            f"{parts[0].name} is a GGUF model of architecture {arch!r}; "
            f"MoE Chat reads GGUF files of {supported}."
        )
    return ModelCheck(
        path=str(parts[0]),
        problems=tuple(problems),
        model_type=model_type or arch,
        num_experts=fields.get(f"{arch}.expert_count"),
        top_k=fields.get(f"{arch}.expert_used_count"),
        num_tensors=len(tensors),
        num_params=sum(int(t.n_elements) for t in tensors),
        weight_bytes=sum(part.stat().st_size for part in parts),
        weight_files=tuple(part.name for part in parts),
        name=_gguf_name(fields, parts[0]),
        expert_bytes=sum(int(t.n_bytes) for t in tensors if GGUF_EXPERTS.search(t.name)),
        resident_bytes=sum(_gguf_resident_bytes(t) for t in tensors if not GGUF_EXPERTS.search(t.name)),
    )


def _gguf_resident_bytes(tensor) -> int:
    """A GGUF tensor as the loader holds it: BF16, but a quantized token embedding in its blocks."""
    if tensor.name == "token_embd.weight" and tensor.tensor_type.name not in FLOAT_DTYPES:
        return int(tensor.n_bytes)
    return 2 * int(tensor.n_elements)


def _gguf_name(fields: dict, first: Path) -> str:
    """The model's name as its GGUF file gives it (`general.name`, else the file's stem) and its
    quant type (`general.file_type`, llama.cpp's names: Q4_K_M …) where the file says."""
    from gguf import LlamaFileType

    name = str(fields.get("general.name") or "").strip() or SPLIT_SUFFIX.sub("", first.stem)
    try:
        quant = LlamaFileType(int(fields["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError, TypeError):
        return name
    return name if quant.lower() in name.lower() else f"{name} ({quant})"
