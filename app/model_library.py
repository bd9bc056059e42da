"""The models on this computer: the bundled demo, downloads, and imported folders.

Downloads live in `<user data dir>/models/<org>--<name>` (MOE_CHAT_DATA_DIR overrides the
data dir). A folder being downloaded holds a `.moe-chat-download` marker until its files are
verified; only then is it listed as installed, and only a marked folder is ever removed when a
download is cancelled.

Imported folders are registered *by reference* (`imported.json` beside the downloads): a model
is tens of GB, so a copy would double the disk it uses and take minutes, and the user keeps
the folder where they put it. Deleting an imported model therefore only forgets it; the files
stay. The demo model is always listed and can never be deleted.

A folder is validated with `engine.model.check.check_model_folder`, which reads safetensors
headers; `check_folder` runs it in a spawned child so this (GUI) process never imports
safetensors.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
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


class ModelImportError(Exception):
    """A folder cannot be imported; the message lists why."""


@dataclass(frozen=True)
class InstalledModel:
    name: str
    path: str
    source: str  # "bundled", "downloaded" or "imported"
    repo_id: str | None = None
    size_bytes: int = 0
    missing: bool = False  # an imported folder that is no longer there

    @property
    def deletable(self) -> bool:
        return self.source != "bundled"


def data_dir() -> Path:
    """The per-user data folder; MOE_CHAT_DATA_DIR overrides it."""
    folder = os.environ.get("MOE_CHAT_DATA_DIR") or platformdirs.user_data_dir("MoE Chat", appauthor=False)
    return Path(folder)


def folder_name(repo_id: str) -> str:
    """'Qwen/Qwen3-30B-A3B' → 'Qwen--Qwen3-30B-A3B'."""
    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name or name in (".", "..") or org in (".", ".."):
        raise ValueError(f"{repo_id!r} is not an 'org/name' Hub id")
    return f"{org}--{name}"


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

    def folder_for(self, repo_id: str) -> Path:
        return self.root / folder_name(repo_id)

    def demo(self) -> InstalledModel:
        path = demo_model_dir()
        return InstalledModel("Demo MoE (bundled)", str(path), "bundled", size_bytes=folder_size(path))

    def list_installed(self) -> list[InstalledModel]:
        """The demo first, then complete downloads, then imported folders."""
        models = [self.demo()]
        if self.root.is_dir():
            for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
                if (folder / "config.json").is_file() and not (folder / PARTIAL_MARKER).exists():
                    repo_id = folder.name.replace("--", "/", 1)
                    models.append(
                        InstalledModel(repo_id, str(folder), "downloaded", repo_id, folder_size(folder))
                    )
        for entry in self._imports():
            path = Path(entry["path"])
            size = folder_size(path) if path.is_dir() else 0
            models.append(InstalledModel(entry["name"], str(path), "imported", None, size, not path.is_dir()))
        return models

    def find(self, repo_id: str) -> InstalledModel | None:
        return next((m for m in self.list_installed() if m.repo_id == repo_id), None)

    def is_installed(self, repo_id: str) -> bool:
        folder = self.folder_for(repo_id)
        return (folder / "config.json").is_file() and not (folder / PARTIAL_MARKER).exists()

    def has_partial(self, repo_id: str) -> bool:
        """A download of `repo_id` was started and never finished."""
        return (self.folder_for(repo_id) / PARTIAL_MARKER).exists()

    # -- changes ---------------------------------------------------------------------------------

    def delete(self, model: InstalledModel) -> None:
        """Remove a download's folder, or forget an imported one (its files stay)."""
        if not model.deletable:
            raise ValueError("The bundled demo model cannot be deleted.")
        if model.source == "imported":
            kept = [e for e in self._imports() if e["path"] != model.path]
            self._write_imports(kept)
            return
        folder = Path(model.path)
        if folder.parent.resolve() != self.root.resolve():
            raise ValueError(f"{folder} is not in the model library ({self.root}); not deleting it.")
        shutil.rmtree(folder)
        log.info("Deleted %s", folder)

    def import_folder(self, path: str | Path) -> InstalledModel:
        """Validate `path` (in a child process) and register it by reference."""
        folder = Path(path).expanduser().resolve()
        check = self._checker(folder)
        if not check.ok:
            raise ModelImportError("\n".join(check.problems))
        for model in self.list_installed():
            if Path(model.path).resolve() == folder:
                return model  # already listed: the demo, a download, or an earlier import
        entry = {"name": folder.name, "path": str(folder)}
        self._write_imports([*self._imports(), entry])
        return InstalledModel(entry["name"], entry["path"], "imported", None, folder_size(folder))

    # -- downloads in progress (used by app.gui.downloads) --------------------------------------------

    def begin_download(self, repo_id: str) -> Path:
        """The folder a download writes into, marked as partial until `finish_download`."""
        folder = self.folder_for(repo_id)
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "config.json").is_file() or (folder / PARTIAL_MARKER).exists():
            (folder / PARTIAL_MARKER).write_text(repo_id + "\n")
        return folder

    def finish_download(self, repo_id: str) -> Path:
        folder = self.folder_for(repo_id)
        (folder / PARTIAL_MARKER).unlink(missing_ok=True)
        return folder

    def discard_download(self, repo_id: str) -> None:
        """Remove an unfinished download's folder; a complete model is never touched."""
        folder = self.folder_for(repo_id)
        if (folder / PARTIAL_MARKER).exists():
            shutil.rmtree(folder, ignore_errors=True)
            log.info("Removed the unfinished download %s", folder)

    def remove_incomplete_files(self, repo_id: str) -> None:
        """Drop the half-fetched `*.incomplete` files a failed download left (they restart anyway)."""
        downloads = self.folder_for(repo_id) / ".cache" / "huggingface" / "download"
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
