"""The models on this computer: the bundled demo, downloads, and imported folders.

A download is named by its key (`ModelSource.key`): the Hub repo id for a whole model
(`Qwen/Qwen3-30B-A3B`), or `repo:QUANT` for the chosen file(s) of one quant of a GGUF repo
(`unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M`, llama.cpp's `-hf` spelling). It lives in
`<user data dir>/models/<org>--<name>` or `<org>--<name>--<QUANT>` (MOE_CHAT_DATA_DIR overrides the
data dir; the Hub allows no "--" in a repo id, so the name maps back to the key), so two quants of
one repo never share a folder. A folder holds a model once it has a config.json or a `.gguf` file.
A folder being downloaded holds a `.moe-chat-download` marker until its files are verified; only
then is it listed as installed, and only a marked folder is ever removed when a download is
cancelled. An installed model's `path` is what the engine's `--model` takes: the folder, or the
GGUF file itself when it sits in a subfolder of the repo.

Imported models — a folder, or a GGUF file — are registered *by reference* (`imported.json`
beside the downloads): a model is tens of GB, so a copy would double the disk it uses and take
minutes, and the user keeps the files where they put them. Deleting an imported model therefore
only forgets it; the files stay. The demo model is always listed and can never be deleted.

A folder is validated with `engine.model.check.check_model_folder`, which reads safetensors
headers or a GGUF header; `check_folder` runs it in a spawned child so this (GUI) process never
imports safetensors or gguf.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from engine.model.check import ModelCheck, check_model_folder
from engine.resources import demo_model_dir

log = logging.getLogger(__name__)

PARTIAL_MARKER = ".moe-chat-download"
IMPORTS_FILE = "imported.json"
CHECK_TIMEOUT_S = 300.0
SPLIT_PART = re.compile(r"-(?P<index>\d{5})-of-\d{5}\.gguf$")  # a split GGUF set's part
QUANT_NAME = re.compile(r"^[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*$")  # Q4_K_M, UD-Q4_K_XL; never "--" or ":"


class ModelImportError(Exception):
    """A folder cannot be imported; the message lists why. `choices`: a folder holding several GGUF
    models, each a file the user may import instead."""

    def __init__(self, message: str, choices: tuple[Path, ...] = ()):
        super().__init__(message)
        self.choices = choices


@dataclass(frozen=True)
class ModelSource:
    """What one download fetches: a whole Hub repo, or only `files` (one quant of a GGUF repo)."""

    repo_id: str
    files: tuple[str, ...] = ()  # () fetches the whole model
    quant: str | None = None  # names the files in the key; required with them

    def __post_init__(self) -> None:
        if ":" in self.repo_id:
            raise ValueError(f"{self.repo_id!r} is not an 'org/name' Hub id")
        folder_name(self.repo_id)  # raises for anything else but 'org/name'
        if self.files and (self.quant is None or not QUANT_NAME.match(self.quant)):
            raise ValueError(f"{self.repo_id}: chosen files need a quant name, not {self.quant!r}")

    @property
    def key(self) -> str:
        """How downloads and the library name it: 'org/name', or 'org/name:QUANT' for chosen files."""
        return f"{self.repo_id}:{self.quant}" if self.files else self.repo_id

    def path_in(self, folder: Path) -> Path:
        """What the engine loads once this is downloaded into `folder`: the folder, or the chosen
        GGUF file (the first part of a split set)."""
        return folder / self.files[0] if self.files else folder


@dataclass(frozen=True)
class InstalledModel:
    name: str
    path: str  # what the engine's --model takes: the folder, or a GGUF file inside it
    source: str  # "bundled", "downloaded" or "imported"
    repo_id: str | None = None  # a download's key (see ModelSource.key)
    size_bytes: int = 0
    missing: bool = False  # an imported folder that is no longer there

    @property
    def deletable(self) -> bool:
        return self.source != "bundled"


def data_dir() -> Path:
    """The per-user data folder; MOE_CHAT_DATA_DIR overrides it."""
    folder = os.environ.get("MOE_CHAT_DATA_DIR") or platformdirs.user_data_dir("MoE Chat", appauthor=False)
    return Path(folder)


def folder_name(key: str) -> str:
    """'Qwen/Qwen3-30B-A3B' → 'Qwen--Qwen3-30B-A3B'; 'org/name:Q4_K_M' → 'org--name--Q4_K_M'."""
    repo_id, colon, quant = key.partition(":")
    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name or name in (".", "..") or org in (".", ".."):
        raise ValueError(f"{repo_id!r} is not an 'org/name' Hub id")
    if "--" in repo_id:
        raise ValueError(f"{repo_id!r} is not an 'org/name' Hub id (the Hub allows no '--')")
    if colon and not QUANT_NAME.match(quant):
        raise ValueError(f"{quant!r} in {key!r} is not a quant name such as Q4_K_M")
    return f"{org}--{name}--{quant}" if colon else f"{org}--{name}"


def key_of_folder(name: str) -> str | None:
    """The download key a library folder's name stands for (the inverse of `folder_name`)."""
    parts = name.split("--")
    if len(parts) == 2:
        return f"{parts[0]}/{parts[1]}"
    if len(parts) == 3:
        return f"{parts[0]}/{parts[1]}:{parts[2]}"
    return None


def gguf_models_in(folder: Path) -> list[Path]:
    """The GGUF models at the top of `folder`: each file, or each split set's first part (as the
    engine reads a folder: engine.model.gguf_file.find_gguf), projector files left out."""
    files = sorted(p for p in folder.glob("*.gguf") if not p.name.startswith("mmproj"))
    return [p for p in files if not (m := SPLIT_PART.search(p.name)) or m["index"] == "00001"]


def path_size(path: Path) -> int:
    """Bytes of a model: a folder's files, or a GGUF file with the other parts of its split set."""
    if path.is_dir():
        return folder_size(path)
    match = SPLIT_PART.search(path.name)
    parts = path.parent.glob(path.name[: match.start()] + "-*-of-*.gguf") if match else [path]
    return sum(part.stat().st_size for part in parts if part.is_file())


def gguf_files_in(folder: Path) -> list[Path]:
    """The `.gguf` files under `folder` (any depth, without the Hub client's `.cache`), sorted."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != ".cache")
        found += [Path(root) / f for f in files if f.endswith(".gguf")]
    return sorted(found)


def model_path(folder: Path) -> Path | None:
    """What the engine loads from a library folder: the folder (config.json or a GGUF at its top),
    or the first GGUF file in a subfolder (the first part of a split set sorts first); None if empty."""
    if (folder / "config.json").is_file() or any(folder.glob("*.gguf")):
        return folder
    nested = gguf_files_in(folder)
    return nested[0] if nested else None


def folder_size(path: Path) -> int:
    """Bytes of every file under `path`, without the Hub client's `.cache` bookkeeping."""
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if d != ".cache"]
        total += sum((Path(root) / f).stat().st_size for f in files if (Path(root) / f).is_file())
    return total


def check_folder(path: str | Path) -> ModelCheck:
    """`check_model_folder(path)` in a spawned child process (it imports safetensors). Blocks."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(check_model_folder, str(path)).result(CHECK_TIMEOUT_S)


class ModelLibrary:
    """Installed models under one root folder (default `<user data dir>/models`)."""

    def __init__(self, root: str | Path | None = None, checker=check_folder):
        self.root = Path(root) if root is not None else data_dir() / "models"
        self._checker = checker

    # -- listing ---------------------------------------------------------------------------------

    def folder_for(self, key: str) -> Path:
        """The folder of the download `key` (a repo id, or 'repo:QUANT')."""
        return self.root / folder_name(key)

    def demo(self) -> InstalledModel:
        path = demo_model_dir()
        return InstalledModel("Demo MoE (bundled)", str(path), "bundled", size_bytes=folder_size(path))

    def list_installed(self) -> list[InstalledModel]:
        """The demo first, then complete downloads, then imported folders."""
        models = [self.demo()]
        if self.root.is_dir():
            for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
                key, path = key_of_folder(folder.name), self._installed_path(folder)
                if key is not None and path is not None:
                    models.append(InstalledModel(key, str(path), "downloaded", key, folder_size(folder)))
        for entry in self._imports():
            path = Path(entry["path"])
            size = path_size(path) if path.exists() else 0
            models.append(InstalledModel(entry["name"], str(path), "imported", None, size, not path.exists()))
        return models

    def name_of(self, path: str | Path) -> str | None:
        """The name an imported model at `path` was listed under (a GGUF's own), or None."""
        target = Path(path).expanduser().resolve()
        return next((e["name"] for e in self._imports() if Path(e["path"]).resolve() == target), None)

    def find(self, key: str) -> InstalledModel | None:
        return next((m for m in self.list_installed() if m.repo_id == key), None)

    def is_installed(self, key: str) -> bool:
        return self.installed_path(key) is not None

    def installed_path(self, key: str) -> Path | None:
        """What the engine's --model takes for the finished download `key`; None if there is none."""
        return self._installed_path(self.folder_for(key))

    @staticmethod
    def _installed_path(folder: Path) -> Path | None:
        if not folder.is_dir() or (folder / PARTIAL_MARKER).exists():
            return None
        return model_path(folder)

    def has_partial(self, key: str) -> bool:
        """A download of `key` was started and never finished."""
        return (self.folder_for(key) / PARTIAL_MARKER).exists()

    # -- changes ---------------------------------------------------------------------------------

    def delete(self, model: InstalledModel) -> None:
        """Remove a download's folder, or forget an imported one (its files stay)."""
        if not model.deletable:
            raise ValueError("The bundled demo model cannot be deleted.")
        if model.source == "imported":
            kept = [e for e in self._imports() if e["path"] != model.path]
            self._write_imports(kept)
            return
        path = Path(model.path).resolve()
        root = self.root.resolve()
        folder = next((p for p in (path, *path.parents) if p.parent == root), None)
        if folder is None:
            raise ValueError(f"{model.path} is not in the model library ({self.root}); not deleting it.")
        shutil.rmtree(folder)
        log.info("Deleted %s", folder)

    def import_model(self, path: str | Path) -> InstalledModel:
        """Validate `path` — a model folder, or a `.gguf` file (a split set's first part) — in a
        child process and register it by reference, named as a GGUF names itself (`general.name`
        and its quant type), else by its folder. A folder holding several GGUF models is refused
        with them as `ModelImportError.choices`."""
        target = Path(path).expanduser().resolve()
        choices = gguf_models_in(target) if target.is_dir() else []
        if len(choices) > 1:
            names = ", ".join(p.name for p in choices)
            raise ModelImportError(
                f"{target} holds several GGUF models ({names}): choose one.", tuple(choices)
            )
        check = self._checker(target)
        if not check.ok:
            raise ModelImportError("\n".join(check.problems))
        for model in self.list_installed():
            if Path(model.path).resolve() == target:
                return model  # already listed: the demo, a download, or an earlier import
        entry = {"name": check.name or target.name, "path": str(target)}
        self._write_imports([*self._imports(), entry])
        return InstalledModel(entry["name"], entry["path"], "imported", None, path_size(target))

    # -- downloads in progress (used by app.gui.models.downloads) ------------------------------------

    def begin_download(self, key: str) -> Path:
        """The folder a download writes into, marked as partial until `finish_download`."""
        folder = self.folder_for(key)
        folder.mkdir(parents=True, exist_ok=True)
        if model_path(folder) is None or (folder / PARTIAL_MARKER).exists():
            (folder / PARTIAL_MARKER).write_text(key + "\n")
        return folder

    def finish_download(self, key: str) -> Path:
        folder = self.folder_for(key)
        (folder / PARTIAL_MARKER).unlink(missing_ok=True)
        return folder

    def discard_download(self, key: str) -> None:
        """Remove an unfinished download's folder; a complete model is never touched."""
        folder = self.folder_for(key)
        if (folder / PARTIAL_MARKER).exists():
            shutil.rmtree(folder, ignore_errors=True)
            log.info("Removed the unfinished download %s", folder)

    def remove_incomplete_files(self, key: str) -> None:
        """Drop the half-fetched `*.incomplete` files a failed download left (they restart anyway)."""
        downloads = self.folder_for(key) / ".cache" / "huggingface" / "download"
        for path in downloads.rglob("*.incomplete") if downloads.is_dir() else ():
            path.unlink(missing_ok=True)

    # -- imported.json ---------------------------------------------------------------------------

    def _imports(self) -> list[dict]:
        path = self.root / IMPORTS_FILE
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            log.warning("Ignoring the unreadable list of imported models %s (%s)", path, err)
            return []
        if not isinstance(entries, list):
            return []
        return [e for e in entries if isinstance(e, dict) and {"name", "path"} <= e.keys()]

    def _write_imports(self, entries: list[dict]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / IMPORTS_FILE
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(entries, indent=2) + "\n", encoding="utf-8")
        temporary.replace(path)
