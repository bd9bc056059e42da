"""Reading a GGUF file — what llama.cpp, LM Studio and Ollama users have on disk.

`GgufCheckpoint` memory-maps a `.gguf` file (or every part of a `-00001-of-0000N.gguf`
split set) with the `gguf` package. Config, tokenizer and chat template come from its
metadata through transformers' own GGUF mapping (`gguf_file=`), with the keys that
mapping does not read filled in (`MISSED_KEYS`). For the resident weights it reads
like `engine.model.checkpoint.Checkpoint`, by Hugging Face parameter name: each
tensor is dequantized (gguf's reference code) and reshaped by transformers' tensor
processor for the architecture, once, at load. Routed experts are never dequantized
here: `expert_blocks` hands their quantized bytes to the expert store as they are.

Every failure is an `EngineError` that names the file and says what to do.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.errors import CorruptCheckpointError, ModelNotFoundError, UnsupportedArchitectureError

log = logging.getLogger(__name__)

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# architectures whose matrices transformers reads with their rows as stored (no Q/K permutation):
# their quantized blocks can be computed on as they lie (engine.resident.ggml_linear)
ROWS_AS_STORED = ("qwen2moe", "qwen3moe")
# tensor types that hold floats, not quantized blocks
DENSE_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
EXPERTS = re.compile(r"^blk\.(?P<layer>\d+)\.ffn_(?P<which>gate|up|down)_exps\.weight$")
# GGUF keys transformers' config mapping does not read (FACTS.md): architecture -> key -> config field
MISSED_KEYS = {
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
}


def find_gguf(path: str | Path) -> list[Path] | None:
    """The GGUF file(s) `path` names: a `.gguf` file, every part of its split set, or the one
    GGUF model in a folder; None for a folder without any. Raises when a set is incomplete."""
    path = Path(path).expanduser()
    if path.is_dir():
        candidates = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
        firsts = [p for p in candidates if not SPLIT.match(p.name) or SPLIT.match(p.name)["index"] == "00001"]
        if not firsts:
            return None
        if len(firsts) > 1:
            names = ", ".join(p.name for p in firsts)
            raise ModelNotFoundError(f"{path} holds several GGUF models ({names}): give the file itself.")
        path = firsts[0]
    elif path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}. Check the path, or download the model first.")
    split = SPLIT.match(path.name)
    if split is None:
        return [path]
    count = int(split["count"])
    parts = [path.with_name(f"{split['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelNotFoundError(
            f"The split GGUF set {split['stem']} has {count} parts, but {', '.join(missing)} is missing "
            f"from {path.parent}. Download every part."
        )
    return parts


class GgufCheckpoint:
    """One GGUF model, memory-mapped; resident tensors read by Hugging Face name after `bind`."""

    def __init__(self, parts: list[Path]):
        from gguf import GGUFReader

        self.parts = parts
        self.folder = parts[0].parent
        self.readers = []
        for part in parts:
            try:
                self.readers.append(GGUFReader(part))
            except (ValueError, OSError, IndexError, KeyError) as err:
                raise CorruptCheckpointError(
                    f"{part} is not a readable GGUF file ({err}). It is truncated or corrupt: "
                    "download it again."
                ) from err
        self.tensors = {t.name: t for reader in self.readers for t in reader.tensors}
        self.file_of = {
            t.name: part for part, reader in zip(parts, self.readers, strict=True) for t in reader.tensors
        }
        self.architecture = self._field("general.architecture")
        self._names: dict[str, str] = {}  # Hugging Face name -> GGUF name, after `bind`
        self._processor = None

    def _field(self, key: str):
        field = self.readers[0].get_field(key)
        if field is None:
            raise CorruptCheckpointError(f"{self.parts[0]} has no {key} in its metadata: not a model file.")
        value = field.contents()
        return value

    def has_field(self, key: str) -> bool:
        return self.readers[0].get_field(key) is not None

    # -- config and tokenizer -------------------------------------------------------------------

    def hf_config(self):
        """transformers' config from the metadata, with what its mapping misses filled in."""
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(str(self.folder), gguf_file=self.parts[0].name)
        except ValueError as err:  # "GGUF model with architecture X is not supported yet."
            raise UnsupportedArchitectureError(
                f"{self.parts[0].name} is a GGUF model of architecture {self.architecture!r}, which "
                f"MoE Chat cannot read from GGUF yet ({err})."
            ) from err
        for key, attribute in MISSED_KEYS.get(self.architecture, {}).items():
            if self.has_field(f"{self.architecture}.{key}"):
                setattr(config, attribute, int(self._field(f"{self.architecture}.{key}")))
        # transformers reads one file: it would tie the head of a split set whose output is not in it
        config.tie_word_embeddings = "output.weight" not in self.tensors
        return config

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.folder), gguf_file=self.parts[0].name)

    # -- resident tensors, by Hugging Face name --------------------------------------------------

    def bind(self, hf_model) -> None:
        """Map the file's non-expert tensors to `hf_model`'s parameter names (transformers' map)."""
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self._processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config={})
        mapping = get_gguf_hf_weights_map(hf_model, self._processor)
        self._names = {
            mapping[name]: name for name in self.tensors if name in mapping and not EXPERTS.match(name)
        }

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self.tensors[self._names[name]].shape))

    def storage_dtype(self) -> torch.dtype:
        """Quantized weights are computed in bfloat16 or float32, as a safetensors bf16 checkpoint."""
        return torch.bfloat16

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name` (a Hugging Face parameter name), dequantized and in transformers' layout."""
        from gguf import dequantize

        gguf_name = self._names[name]
        tensor = self.tensors[gguf_name]
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as err:
            raise CorruptCheckpointError(f"Cannot read {gguf_name} of {self.parts[0].name}: {err}") from err
        parsed = {"tensors": {}, "config": {}}
        result = self._processor.process(
            weights=weights, name=gguf_name, tensor_key_mapping={}, parsed_parameters=parsed
        )
        value = torch.from_numpy(np.array(result.weights))  # a copy: the memory map is read-only
        return value if dtype is None else value.to(dtype)

    def quantized_tensor(self, name: str, also: frozenset = frozenset()):
        """The reader tensor of `name` (a Hugging Face name) when the file keeps it as a matrix of
        quantized blocks, or of a float type in `also`, whose rows are the parameter's; else None
        (read it with `read`)."""
        tensor = self.tensors.get(self._names.get(name, ""))
        if tensor is None or self.architecture not in ROWS_AS_STORED or len(tensor.data.shape) != 2:
            return None
        return None if tensor.tensor_type in DENSE_TYPES - also else tensor

    # -- routed experts, as the file has them ---------------------------------------------------

    def expert_blocks(self, layer: int, which: str):
        """`blk.{layer}.ffn_{which}_exps.weight`: its reader tensor (`data` [E, rows, row bytes] of
        quantized blocks, or [E, rows, cols] of floats) — None when the file has no such tensor."""
        return self.tensors.get(f"blk.{layer}.ffn_{which}_exps.weight")

    def expert_tensor_names(self) -> set[str]:
        return {name for name in self.tensors if EXPERTS.match(name)}

    def close(self) -> None:
        self.readers, self.tensors = [], {}  # the memory maps go with the last reference to them
