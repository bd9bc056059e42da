"""Tune results remembered per (GPU, model, budget, precision), so the next load skips tuning.

Contract: one JSON file, `tune.json` in the user config folder ($MOE_CHAT_CONFIG_DIR, else
platformdirs' `user_config_dir("MoE Chat")`), holding {"version": FORMAT_VERSION, "results": {key: result}}.
Writes go to a temporary file in the same folder and replace the old one in one step, so a
crash never leaves half a file. `get` rebuilds the frozen dataclasses and marks the result
`reused=True`; an unreadable file or an entry of another format is a miss, logged, never an
error. A key changes when the GPU, the model (its config.json, or any weight file's size or
modification time), the budget or the precision changes, so a stale result is never found.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import threading
import types
import typing
from pathlib import Path
from typing import Any

import platformdirs

from engine.tune.types import TuneResult

log = logging.getLogger(__name__)

CONFIG_DIR_ENV = "MOE_CHAT_CONFIG_DIR"
FORMAT_VERSION = 3  # 2: α is per token, not accepted / drafted; 3: every drafter and policy measured
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(model_dir: str | os.PathLike[str]) -> str:
    """A digest of config.json's bytes and each weight file's name, size and mtime (no weight reads)."""
    folder = Path(model_dir)
    digest = hashlib.sha256()
    config = folder / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"<no config.json>")
    for weight in sorted(path for path in folder.iterdir() if path.suffix in WEIGHT_SUFFIXES):
        stat = weight.stat()
        digest.update(f"\0{weight.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]


def tune_key(
    gpu_uuid: str | None, model_dir: str, model_fingerprint: str, budget: str, precision: str
) -> str:
    """A stable key: readable parts for people, then a digest of every part for uniqueness."""
    parts = [gpu_uuid or "no-gpu", str(Path(model_dir).resolve()), model_fingerprint, budget, precision]
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    return f"{parts[0]}|{Path(model_dir).name}|{budget}|{precision}|{digest}"


def default_path() -> Path:
    """Where tune results live: $MOE_CHAT_CONFIG_DIR/tune.json, else the platform's config folder."""
    folder = os.environ.get(CONFIG_DIR_ENV) or platformdirs.user_config_dir("MoE Chat", appauthor=False)
    return Path(folder) / "tune.json"


class TuneStore:
    """Tune results on disk, keyed by `tune_key`; safe to share between threads of one process."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path if path is not None else default_path()
        self._lock = threading.Lock()

    def get(self, key: str) -> TuneResult | None:
        """The stored result for `key`, marked reused; None when absent or unreadable."""
        with self._lock:
            entry = self._read().get(key)
        if entry is None:
            return None
        try:
            result = _build(TuneResult, entry)
        except (TypeError, ValueError, KeyError) as err:
            log.warning("Ignoring the stored tune result for %s in %s: %s", key, self.path, err)
            return None
        if result.key != key:
            log.warning("Ignoring a stored tune result filed under %s but made for %s", key, result.key)
            return None
        return dataclasses.replace(result, reused=True)

    def put(self, result: TuneResult) -> None:
        """Store `result` under its key, replacing any older one."""
        with self._lock:
            results = self._read()
            results[result.key] = dataclasses.asdict(dataclasses.replace(result, reused=False))
            self._write(results)

    def forget(self, key: str) -> None:
        """Drop the result for `key` (re-tune on request); nothing happens when there is none."""
        with self._lock:
            results = self._read()
            if results.pop(key, None) is not None:
                self._write(results)

    def _read(self) -> dict[str, Any]:
        """Every stored entry by key; {} when the file is missing, unreadable or of another format."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            log.warning("Ignoring unreadable tune results in %s: %s", self.path, err)
            return {}
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            log.warning("Ignoring tune results in %s: not format version %d", self.path, FORMAT_VERSION)
            return {}
        results = data.get("results")
        return results if isinstance(results, dict) else {}

    def _write(self, results: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"version": FORMAT_VERSION, "results": results}, indent=1)
        fd, temp_name = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as temp:
                temp.write(payload)
                temp.flush()
                os.fsync(temp.fileno())
            Path(temp_name).replace(self.path)  # atomic: os.replace
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise


def _build(cls: type, data: Any) -> Any:
    """An instance of the frozen dataclass `cls` from its `asdict` form, types checked."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} needs an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {field.name for field in dataclasses.fields(cls)}
    if set(data) != names:
        raise KeyError(f"{cls.__name__} fields differ: {sorted(set(data) ^ names)}")
    return cls(**{name: _convert(hints[name], data[name], f"{cls.__name__}.{name}") for name in names})


def _convert(hint: Any, value: Any, where: str) -> Any:
    """`value` as the type `hint` names: a dataclass, tuple[X, ...], a union, or a plain scalar."""
    if dataclasses.is_dataclass(hint):
        return _build(hint, value)
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list):
            raise TypeError(f"{where} should be a list, got {type(value).__name__}")
        (item_hint, _ellipsis) = typing.get_args(hint)
        return tuple(_convert(item_hint, item, where) for item in value)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _convert(option, value, where)
            except TypeError:
                continue
        raise TypeError(f"{where}: {value!r} is not {hint}")
    if hint is type(None):
        if value is not None:
            raise TypeError(f"{where} should be null")
        return None
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str) and type(value) is hint:
        return value
    if hint is bool and isinstance(value, bool):
        return value
    raise TypeError(f"{where}: {value!r} is not {getattr(hint, '__name__', hint)}")
