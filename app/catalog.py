"""The catalog of supported MoE models, and whether each fits this computer.

`load_catalog()` reads `resources/catalog.json` and checks every entry (a bad one raises
`CatalogError` naming it). An entry is one release as the user downloads it: its `format`
(safetensors-bf16, gguf, mxfp4, fp8), its `quant` (Q4_K_M, Q8_0, …), for GGUF the `file` (or
the `files` of a split set) to fetch, never the repo's other quants, and its KV cache's shape. A
`"status": "coming"` entry is shown with its `status_reason` and cannot be downloaded.

`estimate_fit(entry, ram_bytes, vram_bytes, context_tokens)` says how the engine would place the
model: routed experts in host RAM in their stored precision, the rest (dequantized to BF16) and the
KV cache for the context on the GPU, or everything in RAM without one, and what share of the
experts the GPU's remaining memory could cache; tests/engine/test_fit_estimate.py holds it within
10% of what the loader allocates. RAM comes from psutil; VRAM is passed in (the GUI learns it from
the worker's Ready/Stats events and never touches torch.cuda itself).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import psutil

from app.catalog_checks import BF16, FORMATS, check_release, check_status, check_values
from app.model_library import ModelSource
from engine.config import format_bytes  # noqa: F401 (the picker formats sizes with it from here)
from engine.model import fit_estimate
from engine.model.fit_estimate import (  # noqa: F401 (the catalog's callers and tests use them from here)
    CONTEXT_TOKENS,
    GIB,
    HOST_STORE_FACTORS,
    RAM_OVERHEAD,
    Fit,
    ModelBytes,
    vram_headroom,
)
from engine.model.kv_size import KvShape
from engine.resources import demo_model_dir, resources_dir

log = logging.getLogger(__name__)

CATALOG_FILE = "catalog.json"
# Bits a routed-expert weight takes in a GGUF of this quant, as llama.cpp's quantize writes them:
# Q4_K_M keeps gate/up in Q4_K (4.5) and down in Q6_K (6.5625) in half the layers (its
# use_more_bits rule), Q4_K in the rest; Q5_K_M likewise with Q5_K (5.5). Blocks carry their scales.
GGUF_EXPERT_BITS = {
    "Q4_0": 4.5,
    "IQ4_XS": 4.25,
    "Q4_K_S": 4.5,
    "Q4_K_M": (2 * 4.5 + (6.5625 + 4.5) / 2) / 3,
    "Q5_K_M": (2 * 5.5 + (6.5625 + 5.5) / 2) / 3,
    "Q6_K": 6.5625,
    "Q8_0": 8.5,
    "BF16": 16.0,
}
# Bits of a GGUF's token embedding (llama.cpp gives it the quant's base type)
GGUF_EMBEDDING_BITS = {"Q4_0": 4.5, "Q4_K_S": 4.5, "Q4_K_M": 4.5, "Q5_K_M": 5.5, "Q6_K": 6.5625, "Q8_0": 8.5}


class CatalogError(ValueError):
    """The catalog file is unreadable or one of its entries is malformed."""


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    name: str
    repo_id: str | None  # None for the bundled demo
    architecture: str  # the HF model_type
    total_params: int
    active_params: int
    num_experts: int
    top_k: int
    download_bytes: int  # what the download fetches (approximate unless size_approximate is False)
    size_approximate: bool
    license: str
    gated: bool
    draft_repo: str | None
    expert_share: float  # fraction of the parameters in routed experts
    format: str = BF16  # one of FORMATS
    quant: str | None = None  # Q4_K_M, Q8_0, MXFP4, FP8; None for BF16
    files: tuple[str, ...] = ()  # GGUF: the file, or every part of a split set; () = the whole repo
    status: str = "available"  # or "coming": shown, not downloadable
    status_reason: str = ""  # why a "coming" entry cannot be used yet
    notes: str = ""
    bundled: bool = False
    local_path: str | None = None  # the bundled model's folder
    kv: KvShape | None = None  # the KV cache's shape (the config's layers, KV heads, head size)
    embedding_params: int = 0  # vocab × hidden of an untied token embedding (a GGUF keeps it quantized)

    @property
    def quantized(self) -> bool:
        return self.format != BF16

    @property
    def coming(self) -> bool:
        return self.status == "coming"

    @property
    def source(self) -> ModelSource | None:
        """What a download of this entry fetches; None for the bundled demo."""
        if self.repo_id is None:
            return None
        return ModelSource(self.repo_id, self.files, self.quant if self.files else None)

    @property
    def format_label(self) -> str:
        """'GGUF Q4_K_M', 'BF16', 'MXFP4', 'FP8'."""
        name = FORMATS[self.format]
        return f"{name} {self.quant}" if self.quant and self.quant != name else name

    @property
    def expert_bytes(self) -> int:
        """The routed experts as the download stores them (quantized for GGUF, MXFP4, FP8)."""
        if self.format == "mxfp4":  # only the experts are MXFP4: the file keeps the rest in BF16
            return self.download_bytes - self.resident_bytes
        bits = GGUF_EXPERT_BITS.get(self.quant) if self.format == "gguf" else None
        if bits is not None:  # a GGUF's other tensors are in other types: count the experts' own
            return int(self.total_params * self.expert_share * bits / 8)
        return int(self.download_bytes * self.expert_share)

    @property
    def resident_bytes(self) -> int:
        """Attention, embeddings, norms, routers and shared experts: what stays on the device, in
        BF16 (the loader dequantizes a quantized file's resident weights at load)."""
        if not self.quantized:
            return self.download_bytes - self.expert_bytes
        dense = 2 * self.total_params * (1 - self.expert_share)
        bits = GGUF_EMBEDDING_BITS.get(self.quant) if self.format == "gguf" else None
        if bits is None or not self.embedding_params:
            return int(dense)
        # a GGUF's big token embedding stays in its blocks (engine.resident.ggml_embedding)
        return int(dense - self.embedding_params * (2 - bits / 8))


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "name": str,
    "architecture": str,
    "total_params": int,
    "active_params": int,
    "num_experts": int,
    "top_k": int,
    "download_bytes": int,
    "size_approximate": bool,
    "license": str,
    "gated": bool,
    "expert_share": (float, int),
    "format": str,
}
_OPTIONAL: dict[str, type] = {
    "quant": str,
    "file": str,
    "files": list,
    "status": str,
    "status_reason": str,
    "notes": str,
    "kv": dict,
    "embedding_params": int,
}


_KINDS = {str: "string", list: "list", dict: "object", int: "whole number"}


def catalog_path() -> Path:
    return resources_dir() / CATALOG_FILE


def load_catalog(path: str | Path | None = None) -> tuple[CatalogEntry, ...]:
    """Every catalog entry, validated; the bundled demo's `local_path` filled in."""
    path = Path(path) if path is not None else catalog_path()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        models = raw["models"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CatalogError(f"The model catalog {path} cannot be read ({err}). Reinstall the app.") from err
    if not isinstance(models, list):
        raise CatalogError(f"The model catalog {path}: 'models' must be a list.")
    entries = tuple(_entry(index, item) for index, item in enumerate(models))
    seen: set[str] = set()
    downloads: dict[str, str] = {}
    for entry in entries:
        if entry.id in seen:
            raise CatalogError(f"Catalog entry {entry.id!r}: the id is used twice.")
        seen.add(entry.id)
        if entry.source is not None and not entry.coming:
            other = downloads.setdefault(entry.source.key, entry.id)
            if other != entry.id:
                raise CatalogError(f"Catalog entry {entry.id!r}: downloads the same files as {other!r}.")
    return entries


def _entry(index: int, item: object) -> CatalogEntry:
    label = f"#{index}"
    if isinstance(item, dict) and isinstance(item.get("id"), str):
        label = repr(item["id"])
    try:
        return _parse_entry(item)
    except (TypeError, ValueError) as err:
        raise CatalogError(f"Catalog entry {label}: {err}") from err


def _parse_entry(item: object) -> CatalogEntry:
    if not isinstance(item, dict):
        raise TypeError("must be an object")
    for key, kind in _FIELDS.items():
        value = item.get(key)
        if value is None or isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise TypeError(f"{key!r} is missing or not a {getattr(kind, '__name__', 'number')}")
    for key, kind in _OPTIONAL.items():
        if item.get(key) is not None and not isinstance(item[key], kind):
            raise TypeError(f"{key!r} must be a {_KINDS[kind]}")
    bundled = bool(item.get("bundled", False))
    repo_id, draft = item.get("repo_id"), item.get("draft_repo")
    check_values(item, bundled, repo_id, draft)
    files = check_release(item)
    status = item.get("status") or "available"
    check_status(status, item.get("status_reason") or "")
    return CatalogEntry(
        **{key: item[key] for key in _FIELDS},
        repo_id=repo_id,
        draft_repo=draft,
        quant=item.get("quant"),
        files=files,
        status=status,
        status_reason=item.get("status_reason") or "",
        notes=item.get("notes") or "",
        bundled=bundled,
        local_path=str(demo_model_dir()) if bundled else None,
        kv=KvShape(**item["kv"]) if item.get("kv") is not None else None,
        embedding_params=item.get("embedding_params") or 0,
    )


# -- fit ---------------------------------------------------------------------------------------


def system_ram_bytes() -> int:
    """This computer's physical memory."""
    return int(psutil.virtual_memory().total)


def gpu_memory_bytes() -> int | None:
    """The first GPU's memory from NVML (pynvml, optional), or None without one; never torch here."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def kv_bytes(entry: CatalogEntry, context_tokens: int = CONTEXT_TOKENS) -> int:
    """The KV cache at `context_tokens` tokens, in BF16 (0 when the entry does not say its shape)."""
    return entry.kv.nbytes(context_tokens) if entry.kv is not None else 0


def estimate_fit(
    entry: CatalogEntry, ram_bytes: int, vram_bytes: int | None, context_tokens: int = CONTEXT_TOKENS
) -> Fit:
    """Where the release would live on a computer with `ram_bytes` RAM and `vram_bytes` GPU memory,
    with a KV cache for `context_tokens` tokens (engine.model.fit_estimate, as `python -m engine fit`
    estimates a model on disk)."""
    model = ModelBytes(
        entry.expert_bytes, entry.resident_bytes, kv_bytes(entry, context_tokens), not entry.quantized
    )
    return fit_estimate.estimate_fit(model, ram_bytes, vram_bytes, context_tokens)


# -- formatting, shared by the picker and the download states (and format_bytes from engine.config) --


def format_params(count: int) -> str:
    """30_500_000_000 → '30.5B'."""
    if count >= 10**9:
        return f"{count / 1e9:.1f}B"
    if count >= 10**8:
        return f"{count / 1e6:.0f}M"
    if count >= 10**6:
        return f"{count / 1e6:.1f}M"
    return f"{count / 1e3:.0f}K"


def format_duration(seconds: float) -> str:
    """75 → '1 min 15 s'."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
