"""Importing a model from the window: a folder or a `.gguf` file, by a file dialog or a drop.

`ModelImporter(library, parent, done, failed)` checks a path in a child process
(`ModelLibrary.import_model`, on a `BackgroundCall`) and registers it; where a folder holds several
GGUF models it asks which one (`choose`: a list dialog by default) and imports that file.
`choose_model_file(parent)` is the open-file dialog (GGUF files first); `dropped_model_path(mime)`
is the local model a drag carries (a `.gguf` file or a folder), or None, so that a window accepts
only drops it can import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from PySide6.QtCore import QMimeData
from PySide6.QtWidgets import QFileDialog, QInputDialog, QWidget

from app.gui.models.background import BackgroundCall
from app.model_library import InstalledModel, ModelImportError, ModelLibrary

Choose = Callable[[QWidget, str, Sequence[Path]], Path | None]  # (parent, folder, files) -> the chosen


def choose_from_list(parent: QWidget, folder: str, files: Sequence[Path]) -> Path | None:
    """Which of a folder's GGUF models to import (None: the user cancelled)."""
    names = [path.name for path in files]
    name, ok = QInputDialog.getItem(
        parent, "Choose a model", f"{folder} holds several GGUF models. Import:", names, 0, False
    )
    return files[names.index(name)] if ok and name in names else None


def choose_model_file(parent: QWidget) -> str | None:
    """A `.gguf` file (or a split set's first part) picked in an open-file dialog."""
    path, _ = QFileDialog.getOpenFileName(
        parent, "Open a GGUF model", "", "GGUF models (*.gguf);;All files (*)"
    )
    return path or None


def dropped_model_path(mime: QMimeData) -> str | None:
    """The local model a drag carries: its first local `.gguf` file or folder; None otherwise."""
    for url in mime.urls() if mime.hasUrls() else ():
        path = Path(url.toLocalFile()) if url.isLocalFile() else None
        if path is not None and (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
            return str(path)
    return None


class ModelImporter:
    """Imports one path after another for a window, asking where a folder holds several models."""

    def __init__(
        self,
        library: ModelLibrary,
        parent: QWidget,
        done: Callable[[InstalledModel], None],
        failed: Callable[[str], None],
        choose: Choose | None = None,
    ):
        self.library, self.parent, self.done, self.failed = library, parent, done, failed
        self.choose = choose

    def start(self, path: str) -> None:
        """Check and register `path` in the background; `done(model)` or `failed(message)` follow."""
        BackgroundCall(
            lambda: self.library.import_model(path), self.done, self._refused, owner=self.parent
        ).start()

    def _refused(self, error: Exception) -> None:
        if isinstance(error, ModelImportError) and error.choices:
            choose = self.choose or choose_from_list  # looked up now: a test replaces the dialog
            chosen = choose(self.parent, str(Path(error.choices[0]).parent), error.choices)
            if chosen is None:
                self.failed("Import cancelled.")
            else:
                self.start(str(chosen))
            return
        self.failed(f"Cannot import: {error}")
