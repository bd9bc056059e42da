"""On-disk cache of converted (quantized) expert stores: a second load skips the conversion.

Contract: `load_or_build` returns the store for a `StoreKey` from the cache when a valid
entry exists, and otherwise builds it and writes the entry. The cache never fails a
load: a stale, truncated or corrupt entry is logged, deleted and rebuilt, and a write
that fails (a full disk, a read-only folder) is logged and the load goes on uncached.

Where: `$MOE_CHAT_CACHE_DIR/stores`, else `stores/` in platformdirs' user cache folder
of "moe-chat". One file per (model folder, compute dtype, bits, group size): a
safetensors file with each MoE layer's packed `[E, nbytes]` buffer as `layer.{i}`
and, in its metadata, the format version, the folder's fingerprint (name, size and
mtime of config.json and of every safetensors file and index), the quantization and
the layout. An entry whose metadata differs from the expected one is stale; one whose
size disagrees with its header is truncated. Entries are written to a temporary file
and renamed into place, so no reader ever sees a half-written entry. Reading maps the
file (safetensors) and copies each layer into host memory, pinned for a CUDA device.

Native stores are not cached: reading the checkpoint is already as fast as a copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch
from safetensors import SafetensorError, safe_open

from engine.config import format_bytes
from engine.formats.int_quant import QuantSpec
from engine.formats.layout import ExpertLayout
from engine.store.host_store import ExpertStore, allocate_layer

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the packed layout or the quantization changes
CACHE_DIR_ENV = "MOE_CHAT_CACHE_DIR"
METADATA_KEY = "moe_chat_store"
ABANDONED_AFTER_S = 3600  # a temporary file this old belongs to a write that was killed
_FINGERPRINT_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json")

Progress = Callable[[int, int], None]  # (experts done, total)


class _BadEntry(Exception):
    """A cache entry that cannot be used; `stale` when it is merely out of date."""

    def __init__(self, reason: str, stale: bool = False):
        super().__init__(reason)
        self.stale = stale


def cache_dir() -> Path:
    """The folder of cached stores (created when the first entry is written)."""
    root = os.environ.get(CACHE_DIR_ENV) or platformdirs.user_cache_dir("moe-chat")
    return Path(root).expanduser() / "stores"


def fingerprint(folder: Path) -> list[list]:
    """Name, size and mtime of every file of `folder` whose change changes the experts."""
    files = sorted({path for pattern in _FINGERPRINT_FILES for path in folder.glob(pattern)})
    stats = [(path.name, path.stat()) for path in files]
    return [[name, stat.st_size, stat.st_mtime_ns] for name, stat in stats]


@dataclass(frozen=True)
class StoreKey:
    """What a converted store depends on: the model folder, its compute dtype and quantization."""

    folder: Path
    dtype: torch.dtype
    quant: QuantSpec

    def path(self) -> Path:
        folder = self.folder.resolve()
        digest = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
        dtype = str(self.dtype).removeprefix("torch.")
        name = f"{folder.name}-{self.quant.name}-g{self.quant.group_size}-{dtype}-{digest}.safetensors"
        return cache_dir() / name

    def metadata(self, layout: ExpertLayout, layers: Sequence[int], num_experts: int) -> dict:
        """What a valid entry's metadata must say, exactly."""
        return {
            "format": FORMAT_VERSION,
            "model": fingerprint(self.folder.resolve()),
            "dtype": str(self.dtype).removeprefix("torch."),
            "bits": self.quant.bits,
            "group_size": self.quant.group_size,
            "num_experts": num_experts,
            "layers": list(layers),
            "nbytes": layout.nbytes,
            "fields": [[f.name, list(f.shape), str(f.dtype), f.offset] for f in layout.fields],
        }


def load_or_build(
    key: StoreKey,
    layout: ExpertLayout,
    layers: Sequence[int],
    num_experts: int,
    pin: bool,
    build: Callable[[], ExpertStore],
    progress: Progress | None = None,
) -> ExpertStore:
    """The store for `key`: from the cache, or from `build()` and then written to the cache."""
    metadata = key.metadata(layout, layers, num_experts)
    store = load(key, metadata, layout, pin, progress)
    if store is not None:
        return store
    store = build()
    save(store, key, metadata)
    return store


def load(
    key: StoreKey, metadata: dict, layout: ExpertLayout, pin: bool, progress: Progress | None = None
) -> ExpertStore | None:
    """The cached store, or None when there is no usable entry (a bad one is deleted)."""
    path = key.path()
    if not path.is_file():
        log.info("No cached %s expert store for %s; converting it.", key.quant.name, key.folder)
        return None
    try:
        store = _read(path, metadata, layout, pin, progress)
    except _BadEntry as err:
        level = logging.INFO if err.stale else logging.WARNING
        log.log(level, "Deleting the cached expert store %s (%s); converting the experts again.", path, err)
    except (SafetensorError, OSError, ValueError) as err:
        log.warning(
            "The cached expert store %s is unreadable (%s); deleting it and converting again.", path, err
        )
    else:
        log.info("Loaded the %s expert store of %s from the cache %s", key.quant.name, key.folder, path)
        return store
    with contextlib.suppress(OSError):
        path.unlink()
    return None


def _check_size(path: Path, data_nbytes: int) -> None:
    """A truncated (or padded) entry: its size is not its header's plus the layers'."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
    header_nbytes = struct.unpack("<Q", head)[0] if len(head) == 8 else None
    if header_nbytes is None or size != 8 + header_nbytes + data_nbytes:
        raise _BadEntry(f"{size} bytes, not what its header and {format_bytes(data_nbytes)} of experts make")


def _read(
    path: Path, metadata: dict, layout: ExpertLayout, pin: bool, progress: Progress | None
) -> ExpertStore:
    layers, num_experts = metadata["layers"], metadata["num_experts"]
    _check_size(path, len(layers) * num_experts * layout.nbytes)
    with safe_open(str(path), framework="pt") as entry:
        stored = json.loads((entry.metadata() or {}).get(METADATA_KEY, "null"))
        if stored != json.loads(json.dumps(metadata)):
            raise _BadEntry("made for another version of the model, dtype or format", stale=True)
        buffers = {}
        for done, layer in enumerate(layers, 1):
            source = entry.get_tensor(f"layer.{layer}")  # a view of the mapped file
            if source.dtype != torch.uint8 or tuple(source.shape) != (num_experts, layout.nbytes):
                raise _BadEntry(f"layer {layer} is {source.dtype} {tuple(source.shape)}")
            buffers[layer] = allocate_layer(num_experts, layout.nbytes, pin, layer)
            buffers[layer].copy_(source)
            if progress is not None:
                progress(done * num_experts, len(layers) * num_experts)
    return ExpertStore(layout, buffers, num_experts)


def save(store: ExpertStore, key: StoreKey, metadata: dict) -> bool:
    """Write `store` as the entry for `key`; False (and a warning) when it cannot be written."""
    path = key.path()
    needed = store.nbytes + 2**20
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
        if free < needed:
            log.warning(
                "Not caching the converted expert store: %s needs %s but %s is free in %s. "
                "The next load converts the experts again.",
                key.folder,
                format_bytes(needed),
                format_bytes(free),
                path.parent,
            )
            return False
        _write_atomically(path, store, metadata)
    except OSError as err:
        log.warning(
            "Could not write the converted expert store to %s (%s); the next load converts again.",
            path,
            err,
        )
        return False
    log.info("Cached the %s expert store (%s) at %s", key.quant.name, format_bytes(store.nbytes), path)
    return True


def _remove_abandoned_writes(path: Path) -> None:
    """Temporary files of `path` that a killed process left (an hour old: no writer is alive)."""
    for temp in path.parent.glob(path.name + ".*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - temp.stat().st_mtime > ABANDONED_AFTER_S:
                temp.unlink()


def _write_atomically(path: Path, store: ExpertStore, metadata: dict) -> None:
    _remove_abandoned_writes(path)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            _write_safetensors(f, store, metadata)
            f.flush()
            os.fsync(f.fileno())
        Path(temp_name).replace(path)  # atomic: readers see the old entry or the whole new one
    except BaseException:
        with contextlib.suppress(OSError):
            Path(temp_name).unlink()
        raise


def _write_safetensors(f, store: ExpertStore, metadata: dict) -> None:
    """The safetensors format, streamed layer by layer (`save_file` would copy the whole store)."""
    header: dict = {"__metadata__": {METADATA_KEY: json.dumps(metadata)}}
    offset, layer_nbytes = 0, store.num_experts * store.layout.nbytes
    for layer in store.layer_indices:
        shape = [store.num_experts, store.layout.nbytes]
        header[f"layer.{layer}"] = {
            "dtype": "U8",
            "shape": shape,
            "data_offsets": [offset, offset + layer_nbytes],
        }
        offset += layer_nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for layer in store.layer_indices:
        f.write(store.layer_buffer(layer).cpu().numpy().data)
