"""Lazy reading of a Hugging Face model folder's safetensors weights.

A `Checkpoint` maps every tensor name to the file that holds it (a single
`model.safetensors`, or shards listed in `model.safetensors.index.json`) and
reads tensors, or one index along the first dimension, on demand through
`safe_open` memory maps: nothing is read until asked for, so the loader can
pack experts one at a time without holding a layer twice.

Every failure becomes an `EngineError` naming the file and what to do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors import SafetensorError, safe_open

from engine.errors import CorruptCheckpointError, MissingTensorsError, ModelNotFoundError

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# Tensor dtypes we compute with; anything else (FP8, MXFP4 blocks) is a quantized checkpoint.
SUPPORTED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# Packed quantized values (MXFP4 blocks and scales, FP8 weights, GPTQ/AWQ int32 words): read as they
# are, never cast to a float dtype here (engine.formats.fp8_experts and int4_checkpoint dequantize them).
PACKED_DTYPES = {"U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "I32": torch.int32}


class FloatRows(NamedTuple):
    """A float matrix as ggml rows: its ggml type and its bytes, `[out, in × itemsize]`."""

    tensor_type: GGMLQuantizationType
    data: np.ndarray


class Checkpoint:
    """Name → file map over a folder's safetensors, with lazy reads."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._stack = ExitStack()
        self._handles: dict[Path, object] = {}
        self._stored_as: dict[str, str] = {}  # exposed name -> the name in the file (see `rename`)
        try:
            self._file_of = self._map_tensors()
        except BaseException:
            self.close()  # a later corrupt shard must not leave the earlier ones mapped
            raise

    def _map_tensors(self) -> dict[str, Path]:
        if not self.folder.is_dir():
            raise ModelNotFoundError(
                f"Model folder not found: {self.folder}. Check the path, or download the model first."
            )
        index_path = self.folder / INDEX_NAME
        if index_path.is_file():
            return self._map_from_index(index_path)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            others = [p.name for pattern in ("*.bin", "*.gguf") for p in self.folder.glob(pattern)]
            hint = (
                f" It has {', '.join(others[:3])}: only safetensors weights are supported; "
                "download the safetensors version of the model."
                if others
                else " Is the download complete?"
            )
            raise ModelNotFoundError(f"No *.safetensors weights in {self.folder}.{hint}")
        file_of: dict[str, Path] = {}
        for path in files:
            for name in self._open(path).keys():  # noqa: SIM118 - safe_open is not a dict
                file_of[name] = path
        return file_of

    def _map_from_index(self, index_path: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CorruptCheckpointError(
                f"{index_path} is not a valid safetensors index ({err}). Re-download the model."
            ) from err
        file_of = {name: self.folder / shard for name, shard in weight_map.items()}
        missing = sorted({p.name for p in file_of.values() if not p.is_file()})
        if missing:
            raise CorruptCheckpointError(
                f"{self.folder} is incomplete: shard(s) {', '.join(missing[:4])} listed in "
                f"{INDEX_NAME} are missing. Resume or repeat the download."
            )
        return file_of

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError) as err:
                raise CorruptCheckpointError(
                    f"{path.name} in {self.folder} is truncated or corrupt ({err}). Re-download this file."
                ) from err
            self._handles[path] = handle
        return handle

    def rename(self, renamings) -> None:
        """Expose every tensor under the name transformers' `renamings` give it (their
        `rename_source_key`); reads still use the name in the file."""
        file_of = {}
        for stored, path in self._file_of.items():
            name = stored
            for renaming in renamings:
                name, _ = renaming.rename_source_key(name)
            file_of[name] = path
            if name != stored:
                self._stored_as[name] = self._stored_as.get(stored, stored)
        self._file_of = file_of

    # -- queries --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def _slice(self, name: str):
        path = self._file_of.get(name)
        if path is None:
            raise MissingTensorsError(
                f"Tensor {name!r} is missing from the checkpoint in {self.folder}. "
                "The download is incomplete or the folder mixes two models; download it again."
            )
        try:
            return self._open(path).get_slice(self._stored_as.get(name, name))
        except SafetensorError as err:
            raise CorruptCheckpointError(f"Cannot read {name!r} from {path.name}: {err}") from err

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor, cast to `dtype` when given."""
        return self._convert(name, self._read(name, lambda s: s[:], dtype), dtype)

    def read_index(self, name: str, index: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`tensor[index]` of a stacked tensor, reading only that part of the file."""
        return self._convert(name, self._read(name, lambda s: s[index], dtype), dtype)

    def _read(self, name: str, take, dtype: torch.dtype | None) -> torch.Tensor:
        dtype_name = self.dtype_name(name)
        packed = dtype_name in PACKED_DTYPES and dtype in (None, PACKED_DTYPES[dtype_name])
        if dtype_name not in SUPPORTED_DTYPES and not packed:
            raise CorruptCheckpointError(
                f"Tensor {name!r} is stored as {dtype_name}; quantized weights other than MXFP4 experts "
                "and FP8 checkpoints (int, …) are not supported yet. Use the model's BF16/FP16 release."
            )
        try:
            return take(self._slice(name))
        except SafetensorError as err:
            raise CorruptCheckpointError(f"Cannot read {name!r} in {self.folder}: {err}") from err

    @staticmethod
    def _convert(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    def quantized_tensor(self, name: str, also: frozenset = frozenset()) -> FloatRows | None:
        """`name` as rows of a ggml float type in `also` (BF16, F16: the file's own numbers), the
        way a GGUF file's reader gives a matrix ggml computes (engine.resident.ggml_linear); None
        for a tensor that is not a matrix of such a type."""
        types = {"BF16": GGMLQuantizationType.BF16, "F16": GGMLQuantizationType.F16}
        ggml_type = types.get(self.dtype_name(name)) if name in self else None
        if ggml_type is None or ggml_type not in also or len(self.shape(name)) != 2:
            return None
        return FloatRows(ggml_type, self.read(name).view(torch.uint8).numpy())

    def storage_dtype(self) -> torch.dtype:
        """The dtype most floating tensors are stored in (the checkpoint's working precision)."""
        counts: dict[str, int] = {}
        for name in self._file_of:
            dtype_name = self.dtype_name(name)
            counts[dtype_name] = counts.get(dtype_name, 0) + 1
        floating = {k: v for k, v in counts.items() if k in SUPPORTED_DTYPES}
        if not floating:
            raise CorruptCheckpointError(f"No BF16/FP16/FP32 tensors in {self.folder}.")
        return SUPPORTED_DTYPES[max(floating, key=floating.get)]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
