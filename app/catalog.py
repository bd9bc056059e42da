"""The catalog of supported MoE models, and whether each fits this computer.

`load_catalog()` reads `resources/catalog.json` and checks every entry (a bad one raises
`CatalogError` naming it). An entry is one release as the user downloads it: its `format`
(safetensors-bf16, gguf, mxfp4, fp8), its `quant` (Q4_K_M, Q8_0, …) and, for GGUF, the `file`
(or the `files` of a split set) to fetch from the repo, never the repo's other quants. An entry
with `"status": "coming"` is shown with its `status_reason` and cannot be downloaded: MoE Chat
cannot load it yet.

`estimate_fit(entry, ram_bytes, vram_bytes)` says how the engine would place the model: routed
experts in host RAM, everything else on the GPU (or, without a GPU, everything in RAM), and what
share of the experts the GPU's remaining memory could cache. It counts the entry's own precision:
the experts stay as stored (a GGUF's quantized blocks: download size × expert_share; MXFP4's:
the download less its BF16 rest), while the other weights are computed in BF16 (the loader
dequantizes a GGUF's at load), with the same headroom rule as the loader.

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

from app.model_library import QUANT_NAME, ModelSource
from engine.config import format_bytes
from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.model.check import GGUF_MODEL_TYPES
from engine.resources import demo_model_dir, resources_dir

log = logging.getLogger(__name__)

CATALOG_FILE = "catalog.json"
GIB = 2**30
RAM_OVERHEAD = 2 * GIB  # the worker process: Python, torch, tokenizer, KV cache, activations
RAM_USABLE = 0.85  # the share of RAM the OS and other programs leave to us
TIGHT_RAM = 0.6  # above this share of usable RAM the fit is "tight"
# BF16 experts the loader converts when they do not fit (engine.offload.quant, groups of 64 with a
# bf16 scale and offset each): int8 is 1 + 4/64 bytes a weight, int4 1/2 + 4/64, of BF16's 2
HOST_STORE_FACTORS = {"int8": 17 / 32, "int4": 9 / 32}
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
BF16 = "safetensors-bf16"
FORMATS = {BF16: "BF16", "gguf": "GGUF", "mxfp4": "MXFP4", "fp8": "FP8"}  # format → what the picker says
STATUSES = ("available", "coming")
REASON_CHARS = 80  # a "coming" reason fits the picker's status column (three lines at most)
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")  # llama.cpp's gguf-split


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
        return int(self.download_bytes * self.expert_share)

    @property
    def resident_bytes(self) -> int:
        """Attention, embeddings, norms, routers and shared experts: what stays on the device, in
        BF16 (the loader dequantizes a quantized file's resident weights at load)."""
        if self.quantized:
            return int(2 * self.total_params * (1 - self.expert_share))
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
    "format": str,
}
_OPTIONAL: dict[str, type] = {
    "quant": str,
    "file": str,
    "files": list,
    "status": str,
    "status_reason": str,
    "notes": str,
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
            raise TypeError(f"{key!r} must be a {'list' if kind is list else 'string'}")
    bundled = bool(item.get("bundled", False))
    repo_id, draft = item.get("repo_id"), item.get("draft_repo")
    _check_values(item, bundled, repo_id, draft)
    files = _check_release(item)
    status = item.get("status") or "available"
    _check_status(status, item.get("status_reason") or "")
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
        if value is not None and (not isinstance(value, str) or not _REPO_ID.match(value) or "--" in value):
            raise ValueError(f"{key} {value!r} is not an 'org/name' Hub id")
    if not 0 < item["active_params"] <= item["total_params"]:
        raise ValueError("active_params must be positive and at most total_params")
    if not 0 < item["top_k"] <= item["num_experts"]:
        raise ValueError("top_k must be positive and at most num_experts")
    if not 0 < item["expert_share"] < 1:
        raise ValueError("expert_share must lie between 0 and 1")
    if item["download_bytes"] <= 0:
        raise ValueError("download_bytes must be positive")


def _check_release(item: dict) -> tuple[str, ...]:
    """The format, quant and GGUF file(s) of one release; the files to fetch."""
    form, quant = item["format"], item.get("quant")
    if form not in FORMATS:
        raise ValueError(f"format {form!r} is not one of {', '.join(FORMATS)}")
    if (form == BF16) != (quant is None):
        raise ValueError("a quant (Q4_K_M, MXFP4, FP8…) is needed for a quantized format, and only then")
    if quant is not None and not QUANT_NAME.match(quant):
        raise ValueError(f"quant {quant!r} is not a quant name such as Q4_K_M")
    file, files = item.get("file"), item.get("files")
    if form != "gguf":
        if file is not None or files is not None:
            raise ValueError("'file'/'files' choose what to fetch from a GGUF repo: only for format gguf")
        return ()
    if item["architecture"] not in GGUF_MODEL_TYPES.values():
        readable = ", ".join(sorted(GGUF_MODEL_TYPES.values()))
        raise ValueError(f"MoE Chat reads GGUF files of {readable}, not {item['architecture']!r}")
    if (file is None) == (files is None):
        raise ValueError("a gguf entry names its 'file', or the 'files' of a split set (one of them)")
    names = (file,) if file is not None else tuple(files)
    for name in names:
        parts = name.split("/") if isinstance(name, str) else [""]
        if not isinstance(name, str) or not name.endswith(".gguf") or "" in parts or ".." in parts:
            raise ValueError(f"{name!r} is not the path of a .gguf file in the repo")
    if files is not None:
        _check_split_set(names)
    return names


def _check_split_set(names: tuple[str, ...]) -> None:
    """`files` are every part of one `-0000k-of-0000N.gguf` set, in order."""
    folder, _, name = names[0].rpartition("/")
    first = _SPLIT.match(name)
    count = int(first["count"]) if first else 0
    stem = f"{folder}/{first['stem']}" if folder and first else first["stem"] if first else ""
    if not first or names != tuple(f"{stem}-{k:05d}-of-{count:05d}.gguf" for k in range(1, count + 1)):
        raise ValueError("'files' must list every part of one split set, -00001-of-0000N.gguf first")


def _check_status(status: str, reason: str) -> None:
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {', '.join(STATUSES)}")
    if (status == "coming") != bool(reason):
        raise ValueError("a 'coming' entry says why in status_reason, and only a 'coming' one")
    if len(reason) > REASON_CHARS:
        raise ValueError(f"status_reason must be at most {REASON_CHARS} characters (the notes say more)")


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
    """Where the model would live on a computer with `ram_bytes` RAM and `vram_bytes` GPU memory.

    A BF16 release whose experts do not fit is counted as the loader will keep it: its experts
    converted to int8, or int4 (engine.loader.host_store_quant), said in the summary."""
    spare_vram = None if vram_bytes is None else vram_bytes - entry.resident_bytes - vram_headroom(vram_bytes)
    on_gpu = spare_vram is not None and spare_vram >= 0
    usable_ram = int(ram_bytes * RAM_USABLE)
    stored_as, expert_bytes = "", entry.expert_bytes
    for name, factor in (("", 1.0), *(HOST_STORE_FACTORS.items() if not entry.quantized else ())):
        stored_as, expert_bytes = name, int(entry.expert_bytes * factor)
        # On the GPU only the routed experts stay in RAM; on the CPU the rest of the model does too.
        ram_needed = expert_bytes + (0 if on_gpu else entry.resident_bytes) + RAM_OVERHEAD
        if ram_needed <= usable_ram:
            break
    fits = ram_needed <= usable_ram
    fraction = None  # of the experts the GPU can cache
    if spare_vram is not None:
        fraction = min(1.0, spare_vram / max(expert_bytes, 1)) if on_gpu else 0.0
    summary = _fit_summary(entry, fits, ram_needed, ram_bytes, vram_bytes, on_gpu, fraction)
    if stored_as and fits:
        summary = f"{summary} (experts kept as {stored_as}: outputs differ slightly)"
    if not fits:
        level = "no"
    elif stored_as or (vram_bytes is not None and not on_gpu) or ram_needed > TIGHT_RAM * usable_ram:
        level = "tight"
    else:
        level = "good"
    return Fit(fits, ram_needed, fraction, summary, level)


def _fit_summary(entry, fits, ram_needed, ram_bytes, vram_bytes, on_gpu, fraction) -> str:
    ram = f"~{format_bytes(ram_needed)} of {format_bytes(ram_bytes)} RAM"
    if not fits:
        return f"Too big: needs ~{format_bytes(ram_needed)} RAM, this computer has {format_bytes(ram_bytes)}"
    if vram_bytes is None:
        return f"Fits (CPU only): {ram}"
    if not on_gpu:
        return (
            f"CPU only: the non-expert weights (~{format_bytes(entry.resident_bytes)}) "
            f"exceed the GPU's {format_bytes(vram_bytes)}; {ram}"
        )
    return f"Fits: {ram}; the GPU caches {fraction:.0%} of the experts"


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
