"""Is this folder a model MoE Chat can load? Answered without loading any weights.

`check_model_folder(path)` reads config.json, lists the tokenizer files and reads the
safetensors headers (names, dtypes, shapes; `safe_open` validates that each file is as long as
its header says) and compares them with `model.safetensors.index.json`. It returns a
`ModelCheck` that lists every problem in the words the loader would use, so a download or an
import can be refused before the worker spends minutes on it. Importing this module is light
(no torch, no safetensors): the GUI unpickles `ModelCheck` results. Calling
`check_model_folder` imports `safetensors` (and numpy), so the GUI runs it in a child process
(`app.model_library.check_folder`), never in its own.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UnsupportedQuantizationError
from engine.model.adapters import SUPPORTED_MODEL_TYPES, get_architecture
from engine.model.check_gguf import check_gguf
from engine.model.derived_config import base_model_type
from engine.model.model_check import FLOAT_DTYPES, ModelCheck

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# a checkpoint's routed-expert tensors (per-expert or fused, any family's naming), not shared experts
ROUTED_EXPERTS = re.compile(r"\.experts\.")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "BOOL": 1}


def check_model_folder(path: str | Path) -> ModelCheck:
    """Validate `path` as a Hugging Face MoE folder, or a GGUF file (a folder holding one, a split
    set), that MoE Chat supports, reading headers only."""
    from engine.errors import EngineError
    from engine.model.gguf_file import find_gguf

    folder = Path(path).expanduser()
    try:
        parts = find_gguf(folder)
    except EngineError as err:
        return ModelCheck(str(folder), (str(err),))
    if parts is not None:
        return check_gguf(parts)
    if not folder.is_dir():
        what = "is a file; give the model's folder" if folder.exists() else "does not exist"
        return ModelCheck(str(folder), (f"Model folder not found: {folder} {what}.",))
    problems: list[str] = []
    config = _read_config(folder, problems)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        problems.append(
            f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}). "
            "Download the model's tokenizer files into the same folder."
        )
    weights = _read_weights(folder, problems, quant=_quant_method(config))
    return ModelCheck(
        path=str(folder),
        problems=tuple(problems),
        model_type=config.get("model_type"),
        num_experts=_first_int(config, "num_experts", "num_local_experts", "n_routed_experts"),
        top_k=_first_int(config, "num_experts_per_tok", "moe_topk", "top_k"),
        num_tensors=weights.num_tensors,
        num_params=weights.num_params,
        weight_bytes=weights.nbytes,
        weight_files=tuple(sorted(weights.files)),
        expert_bytes=weights.expert_bytes,
        resident_bytes=weights.resident_bytes,
        float_experts=weights.float_experts,
    )


def unsupported_architecture_message(model_type: object) -> str:
    """The loader's message for a model type it has no adapter for (engine.model.adapters)."""
    return (
        f"Architecture {model_type!r} is not supported. MoE Chat runs Mixture-of-Experts models of "
        f"these types: {', '.join(SUPPORTED_MODEL_TYPES)}."
    )


def _read_config(folder: Path, problems: list[str]) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        problems.append(
            f"{folder} has no config.json; it is not a Hugging Face model folder. "
            "Give the folder that holds config.json and the *.safetensors weights."
        )
        return {}
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        problems.append(f"{config_path} is not valid JSON ({err}). Re-download the model.")
        return {}
    if not isinstance(config, dict) or "model_type" not in config:
        problems.append(
            f"{config_path} has no model_type; it is not a transformers model config. "
            "Re-download the model's config.json."
        )
        return config if isinstance(config, dict) else {}
    problems.extend(config_problems(config))
    return config


def config_problems(config: dict) -> list[str]:
    """Why a parsed config.json rules the model out: an unsupported type, or pre-quantized weights."""
    problems = []
    family = base_model_type(config)  # a remote-code derivative reads as its base (Kimi-K2: deepseek_v3)
    if family is None:
        problems.append(unsupported_architecture_message(config.get("model_type")))
    quant = config.get("quantization_config")
    method = _quant_method(config) or "?"
    if quant and not _loadable(family, method):
        problems.append(
            f"This checkpoint is pre-quantized ({method}); MoE Chat loads BF16/FP16/FP32 weights, "
            "FP8, GPTQ/AWQ int4 and MXFP4 checkpoints and GGUF files. "
            "Use the model's BF16 release or a GGUF file."
        )
    elif method in ("gptq", "awq") and isinstance(quant, dict) and quant.get("bits", 4) != 4:
        problems.append(
            f"This checkpoint is {method} with {quant.get('bits')}-bit weights; MoE Chat loads {method} "
            "int4 only. Use the model's 4-bit or BF16 release, or a GGUF file."
        )
    elif method == COMPRESSED_TENSORS:
        try:
            compressed_tensors_weights(quant)
        except UnsupportedQuantizationError as err:
            problems.append(str(err))
    return problems


COMPRESSED_TENSORS = "compressed-tensors"
# compressed-tensors weights MoE Chat reads: (type, bits) -> on-disk formats, scale strategies
CT_READABLE = {
    ("float", 8): (("float-quantized", "naive-quantized"), ("tensor", "channel", "block")),
    ("int", 4): (("pack-quantized",), ("group", "channel")),
}
CT_SCHEME_KEYS = ("format", "type", "num_bits", "strategy", "group_size", "symmetric", "actorder")


def compressed_tensors_weights(quant: dict) -> dict:
    """The weight arguments (and `format`) of a compressed-tensors `quantization_config` MoE Chat
    reads, one scheme for every quantized Linear; else `UnsupportedQuantizationError`, naming it."""
    schemes = [g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = [dict(g.get("weights") or {}, format=g.get("format") or quant.get("format")) for g in schemes]
    found = {tuple(str(w.get(key)) for key in (*CT_SCHEME_KEYS, "block_structure")) for w in weights}
    args = weights[0] if weights else {}
    kind = (str(args.get("type")), int(args.get("num_bits") or 0))
    formats, strategies = CT_READABLE.get(kind, ((), ()))
    problem = None
    if len(found) != 1:
        problem = f"{len(found) or 'no'} weight schemes (MoE Chat reads one for all Linears)"
    elif kind not in CT_READABLE or args["format"] not in formats:
        problem = f"{kind[1]}-bit {kind[0]} weights in the {args['format']} format"
    elif args.get("strategy") not in strategies:
        problem = f"{kind[1]}-bit {kind[0]} weights with {args.get('strategy')} scales"
    elif (quant.get("sparsity_config") or {}).get("format", "dense") != "dense" or quant.get(
        "transform_config"
    ):
        problem = "sparse or transformed weights"
    if problem:
        raise UnsupportedQuantizationError(
            f"This compressed-tensors checkpoint has {problem}; MoE Chat reads FP8 float-quantized "
            "(tensor, channel or block scales) and 4-bit pack-quantized (group or channel) ones. "
            "Use the model's BF16 release or a GGUF file."
        )
    return args


def _quant_method(config: dict) -> str | None:
    quant = config.get("quantization_config")
    return str(quant.get("quant_method", "?")).lower() if isinstance(quant, dict) else None


@dataclass
class _Weights:
    files: set[str]
    num_tensors: int = 0
    num_params: int = 0
    nbytes: int = 0
    expert_bytes: int = 0  # the routed experts as stored
    resident_bytes: int = 0  # the rest in BF16, as the loader holds it
    float_experts: bool = False


def _read_weights(folder: Path, problems: list[str], quant: str | None = None) -> _Weights:
    """Every safetensors header in the folder (or in its index), checked against the index.
    The config's `quant` method says which packed dtypes are the checkpoint's format (`_is_packed`)."""
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        weight_map = _read_index(index_path, problems)
        if weight_map is None:
            return _Weights(set())
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (folder / name).is_file()]
        if missing:
            problems.append(
                f"{folder} is incomplete: shard(s) {', '.join(missing[:4])} listed in "
                f"{INDEX_NAME} are missing. Resume or repeat the download."
            )
            return _Weights(set(files) - set(missing))
    else:
        weight_map = None
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            problems.append(_no_weights_message(folder))
            return _Weights(set())
    weights = _Weights(set(files))
    found: dict[str, str] = {}
    for name in files:
        headers = _read_header(folder / name, problems)
        if headers is None:
            continue
        for tensor, (dtype, shape) in headers.items():
            found[tensor] = name
            _count(weights, tensor, dtype, shape)
        _check_dtypes(folder / name, headers, problems, quant)
    if weight_map is not None:
        _check_against_index(folder, weight_map, found, problems)
    return weights


def _read_index(index_path: Path, problems: list[str]) -> dict[str, str] | None:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as err:
        problems.append(f"{index_path} is not a valid safetensors index ({err}). Re-download the model.")
        return None
    return {str(k): str(v) for k, v in weight_map.items()}


def _read_header(path: Path, problems: list[str]) -> dict[str, tuple[str, list[int]]] | None:
    """{tensor: (dtype, shape)} from one file's header, or None (and a problem) if it is corrupt."""
    from safetensors import SafetensorError, safe_open  # here, not at import: see the module docstring

    try:
        with safe_open(str(path), framework="numpy") as handle:
            return {
                name: (handle.get_slice(name).get_dtype(), handle.get_slice(name).get_shape())
                for name in handle.keys()  # noqa: SIM118 - safe_open is not a dict
            }
    except (SafetensorError, OSError) as err:
        problems.append(
            f"{path.name} in {path.parent} is truncated or corrupt ({err}). Re-download this file."
        )
        return None


def _count(weights: _Weights, name: str, dtype: str, shape: list[int]) -> None:
    numel = math.prod(shape)
    nbytes = numel * FLOAT_DTYPES.get(dtype, _DTYPE_BYTES.get(dtype, 1))
    weights.num_tensors += 1
    weights.num_params += numel
    weights.nbytes += nbytes
    if ROUTED_EXPERTS.search(name):
        weights.expert_bytes += nbytes
        weights.float_experts = weights.float_experts or dtype in ("BF16", "F16")
    else:
        weights.resident_bytes += 2 * numel


def _check_dtypes(
    path: Path, headers: dict[str, tuple[str, list[int]]], problems: list[str], quant: str | None = None
) -> None:
    """Weights stored in FP8, MXFP4 blocks or integers mean a quantized checkpoint: those its
    config explains load (`_is_packed`)."""
    odd = sorted({dtype for name, (dtype, _) in headers.items() if _is_odd(name, dtype, quant)})
    if odd:
        problems.append(
            f"{path.name} stores weights as {', '.join(odd)}; quantized checkpoints (FP8, MXFP4, int) "
            "are not supported. Use the model's BF16/FP16 release."
        )


def _loadable(family: str | None, method: str) -> bool:
    """The loader's rule (engine.model.folder): a method the family's adapter does not refuse (None:
    an unsupported family, the problem reported instead)."""
    return family is None or method.lower() not in get_architecture(family).unsupported_quantization


def _is_odd(name: str, dtype: str, quant: str | None) -> bool:
    """A weight that is neither floats nor the checkpoint's own packed format."""
    return dtype not in FLOAT_DTYPES and _is_weight(name) and not _is_packed(name, dtype, quant)


def _is_mxfp4(name: str, dtype: str) -> bool:
    """OpenAI's MXFP4 experts: `…_blocks` and `…_scales` bytes (engine.formats.mxfp4_experts)."""
    return dtype == "U8" and name.endswith(("_blocks", "_scales"))


def _is_packed(name: str, dtype: str, quant: str | None) -> bool:
    """A quantized checkpoint's own packed tensors: MXFP4 blocks, FP8 weights, GPTQ/AWQ and
    compressed-tensors int32 words (engine.formats.fp8_experts, int4_experts, compressed_tensors)."""
    if _is_mxfp4(name, dtype):
        return True
    if quant == "fp8":
        return dtype == "F8_E4M3"
    if quant == COMPRESSED_TENSORS:
        packed = name.endswith((".weight_packed", ".weight_zero_point", ".weight_g_idx", ".weight_shape"))
        return dtype == "F8_E4M3" or (dtype in ("I32", "I64") and packed)
    return quant in ("gptq", "awq") and dtype == "I32" and name.endswith((".qweight", ".qzeros", ".g_idx"))


def _is_weight(name: str) -> bool:
    """Integer tensors that are bookkeeping, not weights, are allowed in any checkpoint."""
    return not name.endswith(("position_ids", "num_batches_tracked"))


def _check_against_index(
    folder: Path, weight_map: dict[str, str], found: dict[str, str], problems: list[str]
) -> None:
    absent = sorted(name for name in weight_map if name not in found)
    moved = sorted(n for n, shard in weight_map.items() if n in found and found[n] != shard)
    if absent:
        shown = ", ".join(absent[:3]) + (f" and {len(absent) - 3} more" if len(absent) > 3 else "")
        problems.append(
            f"The checkpoint in {folder} lacks {len(absent)} tensor(s) its index lists: {shown}. "
            "The download is incomplete or the folder mixes two models."
        )
    if moved:
        problems.append(
            f"{INDEX_NAME} in {folder} puts {moved[0]} in {weight_map[moved[0]]}, but it is in "
            f"{found[moved[0]]}. The index belongs to another version of the model; re-download it."
        )


def _no_weights_message(folder: Path) -> str:
    others = [p.name for pattern in ("*.bin", "*.gguf", "*.pt") for p in folder.glob(pattern)]
    hint = (
        f" It has {', '.join(others[:3])}: only safetensors weights are supported; "
        "download the safetensors version of the model."
        if others
        else " Is the download complete?"
    )
    return f"No *.safetensors weights in {folder}.{hint}"


def _first_int(config: dict, *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
