"""The catalog of supported MoE models, and whether each fits this computer.

`load_catalog()` reads `resources/catalog.json` and checks every entry (a bad one raises
`CatalogError` naming it). `estimate_fit(entry, ram_bytes, vram_bytes)` says how the engine
would place the model: routed experts in host RAM, everything else on the GPU (or, without a
GPU, everything in RAM), and what share of the experts the GPU's remaining memory could cache.
It is an estimate from the catalog's BF16 sizes, with the same headroom rule as the loader.

RAM comes from psutil (`system_ram_bytes`); VRAM is passed in: the GUI learns it from the
worker's Ready/Stats events and never touches torch.cuda itself.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import psutil

from engine.config import format_bytes
from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.resources import demo_model_dir, resources_dir

log = logging.getLogger(__name__)

CATALOG_FILE = "catalog.json"
GIB = 2**30
RAM_OVERHEAD = 2 * GIB  # the worker process: Python, torch, tokenizer, KV cache, activations
RAM_USABLE = 0.85  # the share of RAM the OS and other programs leave to us
TIGHT_RAM = 0.6  # above this share of usable RAM the fit is "tight"
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


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
    download_bytes: int  # BF16 safetensors (approximate unless size_approximate is False)
    size_approximate: bool
    license: str
    gated: bool
    draft_repo: str | None
    expert_share: float  # fraction of the parameters in routed experts
    notes: str = ""
    bundled: bool = False
    local_path: str | None = None  # the bundled model's folder

    @property
    def expert_bytes(self) -> int:
        return int(self.download_bytes * self.expert_share)

    @property
    def resident_bytes(self) -> int:
        """Attention, embeddings, norms, routers and shared experts: what stays on the device."""
        return self.download_bytes - self.expert_bytes


@dataclass(frozen=True)
class Fit:
    fits_in_ram: bool
    ram_needed_bytes: int
    gpu_cacheable_fraction: float | None  # of the routed experts; None without a GPU
    summary: str
    level: str  # "good", "tight" or "no": the colour cue


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
}


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
    for entry in entries:
        if entry.id in seen:
            raise CatalogError(f"Catalog entry {entry.id!r}: the id is used twice.")
        seen.add(entry.id)
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
    bundled = bool(item.get("bundled", False))
    repo_id, draft = item.get("repo_id"), item.get("draft_repo")
    _check_values(item, bundled, repo_id, draft)
    return CatalogEntry(
        **{key: item[key] for key in _FIELDS},
        repo_id=repo_id,
        draft_repo=draft,
        notes=str(item.get("notes", "")),
        bundled=bundled,
        local_path=str(demo_model_dir()) if bundled else None,
    )


def _check_values(item: dict, bundled: bool, repo_id: object, draft: object) -> None:
    if item["architecture"] not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"architecture {item['architecture']!r} is not one MoE Chat supports "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if bundled == (repo_id is not None):
        raise ValueError("needs a repo_id, or bundled: true, but not both")
    for key, value in (("repo_id", repo_id), ("draft_repo", draft)):
        if value is not None and (not isinstance(value, str) or not _REPO_ID.match(value)):
            raise ValueError(f"{key} {value!r} is not an 'org/name' Hub id")
    if not 0 < item["active_params"] <= item["total_params"]:
        raise ValueError("active_params must be positive and at most total_params")
    if not 0 < item["top_k"] <= item["num_experts"]:
        raise ValueError("top_k must be positive and at most num_experts")
    if not 0 < item["expert_share"] < 1:
        raise ValueError("expert_share must lie between 0 and 1")
    if item["download_bytes"] <= 0:
        raise ValueError("download_bytes must be positive")


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


def vram_headroom(vram_bytes: int) -> int:
    """Device memory the loader's auto budget keeps for activations and the allocator."""
    return max(GIB, vram_bytes // 10)


def estimate_fit(entry: CatalogEntry, ram_bytes: int, vram_bytes: int | None) -> Fit:
    """Where the model would live on a computer with `ram_bytes` RAM and `vram_bytes` GPU memory."""
    spare_vram = None if vram_bytes is None else vram_bytes - entry.resident_bytes - vram_headroom(vram_bytes)
    on_gpu = spare_vram is not None and spare_vram >= 0
    # On the GPU only the routed experts stay in RAM; on the CPU the whole model does.
    ram_needed = (entry.expert_bytes if on_gpu else entry.download_bytes) + RAM_OVERHEAD
    usable_ram = int(ram_bytes * RAM_USABLE)
    fits = ram_needed <= usable_ram
    fraction = None  # of the experts the GPU can cache
    if spare_vram is not None:
        fraction = min(1.0, spare_vram / max(entry.expert_bytes, 1)) if on_gpu else 0.0
    ram = f"~{format_bytes(ram_needed)} of {format_bytes(ram_bytes)} RAM"
    if not fits:
        summary = (
            f"Too big: needs ~{format_bytes(ram_needed)} RAM, this computer has {format_bytes(ram_bytes)}"
        )
    elif vram_bytes is None:
        summary = f"Fits (CPU only): {ram}"
    elif not on_gpu:
        summary = (
            f"CPU only: the non-expert weights (~{format_bytes(entry.resident_bytes)}) "
            f"exceed the GPU's {format_bytes(vram_bytes)}; {ram}"
        )
    else:
        summary = f"Fits: {ram}; the GPU caches {fraction:.0%} of the experts"
    if not fits:
        level = "no"
    elif (vram_bytes is not None and not on_gpu) or ram_needed > TIGHT_RAM * usable_ram:
        level = "tight"
    else:
        level = "good"
    return Fit(fits, ram_needed, fraction, summary, level)


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
