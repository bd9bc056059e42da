"""Pieces of the model picker: catalog cells, a download's row widgets, the local-models page.

`catalog_cells(entry)` are the texts of a catalog row by column, its release's format and quant
among them. `fitted_widths` shrinks a table's columns towards their minimum widths to fit a narrow
dialog (the picker puts the columns the user acts on first, so they stay in view).

`DownloadRow` is what a table shows for a model that can be downloaded: a status line over a
thin progress bar, and Download / Cancel / Retry / Delete buttons, of which only those that
make sense in the current state are visible. `show(progress, installed, partial)` is the only
way its state changes, so the catalog and the search results render a download the same way.
It is named by the download's key (`app.model_library.ModelSource.key`).

`LocalModelsPage` lists the installed models (the demo, downloads, imported files and folders)
with Open a GGUF file…, Import a folder… and Delete; imports go through `ModelImporter`
(app.gui.models.model_import) and are registered by reference (see `app.model_library`).

Blocking work (a folder check in a child process) runs on a `BackgroundCall`
(app.gui.models.background).
"""

from __future__ import annotations

import logging

from PySide6.QtCore import Signal
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.catalog import CatalogEntry, format_bytes, format_params
from app.download_child import DownloadProgress, DownloadState
from app.gui.models.model_import import ModelImporter, choose_model_file
from app.model_library import InstalledModel, ModelLibrary

log = logging.getLogger(__name__)

FAILED_COLOUR = "#b3261e"
INSTALLED_COLOUR = "#1b7f3b"
SELECTION_COLOUR = "#cfe2f6"
LOCAL_COLUMNS = ("Model", "Source", "Size", "Location")
NBSP = "\u00a0"
STATUS_MARGINS = (6, 2, 6, 2)


def catalog_cells(entry: CatalogEntry) -> dict[str, str]:
    """Model and repo, architecture, parameters, experts, format and quant, download size, licence."""
    size = format_bytes(entry.download_bytes)
    kind, _, quant = entry.format_label.partition(" ")
    total, active = format_params(entry.total_params), format_params(entry.active_params)
    return {
        "Model": f"{entry.name}\n{entry.repo_id or 'bundled with the app'}",
        "Architecture": entry.architecture,
        "Parameters": f"{total} total\n{active} active",
        "Experts": f"{entry.num_experts} experts\ntop-{entry.top_k}",
        "Format": f"{kind}\n{quant}" if quant else f"{kind}\nsafetensors",
        "Download": f"~{size}" if entry.size_approximate and not entry.bundled else size,
        "Licence": entry.license + ("\ngated" if entry.gated else ""),
    }


def fitted_widths(preferred: tuple[int, ...], minimum: tuple[int, ...], width: int) -> list[int]:
    """Column widths that fit `width`: the preferred ones where they fit, else each column shrunk
    by the same share of its slack towards its minimum (never below it: then the table scrolls)."""
    excess = sum(preferred) - width
    slack = sum(p - m for p, m in zip(preferred, minimum, strict=True))
    if excess <= 0 or slack <= 0:
        return list(preferred)
    share = min(1.0, excess / slack)
    return [round(p - (p - m) * share) for p, m in zip(preferred, minimum, strict=True)]


def status_label(text: str, colour: str = "", tooltip: str = "") -> QWidget:
    """A cell with a wrapped label and the same margins as a download's status (its colour
    survives the row's selection, unlike an item's)."""
    cell = QWidget()
    layout = QVBoxLayout(cell)
    layout.setContentsMargins(*STATUS_MARGINS)
    label = QLabel(text)
    label.setObjectName("cell_label")
    label.setWordWrap(True)
    label.setToolTip(tooltip)
    if colour:
        label.setStyleSheet(f"color: {colour};")
    layout.addWidget(label)
    return cell


def cell_text(cell: QWidget) -> str:
    """The text of a `status_label` cell."""
    return cell.findChild(QLabel, "cell_label").text()


def make_table(columns: tuple[str, ...], widths: tuple[int, ...], row_height: int) -> QTableWidget:
    """A read-only table that selects whole rows, one at a time; the last column stretches."""
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(columns)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.setWordWrap(True)
    table.verticalHeader().setVisible(False)
    table.verticalHeader().setDefaultSectionSize(row_height)
    for column, width in enumerate(widths):
        table.setColumnWidth(column, width)
    table.horizontalHeader().setSectionResizeMode(len(columns) - 1, QHeaderView.ResizeMode.Stretch)
    # A pale selection keeps the green/amber/red texts and the status widgets' labels readable.
    palette = table.palette()
    for group in (QPalette.ColorGroup.Active, QPalette.ColorGroup.Inactive):
        palette.setColor(group, QPalette.ColorRole.Highlight, QColor(SELECTION_COLOUR))
        palette.setColor(group, QPalette.ColorRole.HighlightedText, palette.color(QPalette.ColorRole.Text))
    table.setPalette(palette)
    return table


class DownloadRow:
    """The status and action widgets of one downloadable model in one table."""

    def __init__(self, key: str, where: str = "catalog"):
        self.key = key  # the download's key: a repo id, or 'repo:QUANT'
        self.where = where  # which table holds it
        self.status_label = QLabel()
        self.status_label.setWordWrap(True)
        self.progress_bar = QProgressBar()
        self.progress_bar.setTextVisible(False)
        self.progress_bar.setFixedHeight(6)
        self.status = QWidget()
        status_layout = QVBoxLayout(self.status)
        status_layout.setContentsMargins(*STATUS_MARGINS)
        status_layout.setSpacing(2)
        status_layout.addWidget(self.status_label)
        status_layout.addWidget(self.progress_bar)
        self.download_button = QPushButton("Download")
        self.cancel_button = QPushButton("Cancel")
        self.retry_button = QPushButton("Retry")
        self.delete_button = QPushButton("Delete")
        self.actions = QWidget()
        actions_layout = QHBoxLayout(self.actions)
        actions_layout.setContentsMargins(*STATUS_MARGINS)
        for button in self._buttons():
            actions_layout.addWidget(button)
        actions_layout.addStretch(1)

    def _buttons(self) -> tuple[QPushButton, ...]:
        return (self.download_button, self.cancel_button, self.retry_button, self.delete_button)

    def visible_buttons(self) -> list[str]:
        return [b.text() for b in self._buttons() if not b.isHidden()]

    def show(self, progress: DownloadProgress | None, installed: bool, partial: bool) -> None:
        """Render the download's newest state."""
        state = progress.state if progress is not None else None
        if state is not None and state.active:
            text, colour, buttons = progress.describe(), "", {self.cancel_button}
        elif installed:
            text, colour, buttons = "Installed ✓", INSTALLED_COLOUR, {self.delete_button}
        elif state in (DownloadState.FAILED, DownloadState.CANCELLED):
            colour = FAILED_COLOUR if state is DownloadState.FAILED else ""
            text, buttons = progress.describe(), {self.retry_button}
        elif partial:
            text, colour = "Incomplete: Download fetches the missing files", ""
            buttons = {self.download_button}
        else:
            text, colour, buttons = "Not downloaded", "", {self.download_button}
        if state is not None and state.active:  # wrap only between the parts, never inside "3.0 GiB"
            self.status_label.setText(" · ".join(part.replace(" ", NBSP) for part in text.split(" · ")))
        else:
            self.status_label.setText(text)
        self.status_label.setToolTip(text)
        self.status_label.setStyleSheet(f"color: {colour};" if colour else "")
        for button in self._buttons():
            button.setVisible(button in buttons)
        self._show_bar(progress if state is not None and state.active else None)

    def _show_bar(self, progress: DownloadProgress | None) -> None:
        self.progress_bar.setVisible(progress is not None)
        if progress is None:
            return
        if progress.fraction is None:
            self.progress_bar.setRange(0, 0)  # busy: the size is not known yet
        else:
            self.progress_bar.setRange(0, 1000)
            self.progress_bar.setValue(round(progress.fraction * 1000))


class LocalModelsPage(QWidget):
    """The installed models, Import… and Delete."""

    sig_message = Signal(str)
    """A line for the picker's message area."""
    sig_changed = Signal()
    """The installed models changed (an import or a delete)."""

    def __init__(self, library: ModelLibrary, parent: QWidget | None = None):
        super().__init__(parent)
        self.library = library
        self.installed: list[InstalledModel] = []
        file_button = QPushButton("Open a GGUF file…")
        file_button.clicked.connect(self._choose_file)
        import_button = QPushButton("Import a folder…")
        import_button.clicked.connect(self._choose_folder)
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self._delete_selected)
        note = QLabel(
            "An imported file or folder stays where it is: MoE Chat checks it and remembers the path "
            "(or drop it on the window). Deleting an imported model only forgets it; deleting a "
            "download removes its files."
        )
        note.setWordWrap(True)
        self.table = make_table(LOCAL_COLUMNS, (260, 100, 90, 600), row_height=28)
        self.table.itemSelectionChanged.connect(self._update_delete_button)
        row = QHBoxLayout()
        row.addWidget(file_button)
        row.addWidget(import_button)
        row.addWidget(self.delete_button)
        row.addWidget(note, 1)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.table, 1)
        self.refresh()

    def refresh(self) -> None:
        self.installed = self.library.list_installed()
        self.table.setRowCount(len(self.installed))
        for row, model in enumerate(self.installed):
            source = "missing" if model.missing else model.source
            for column, text in enumerate((model.name, source, format_bytes(model.size_bytes), model.path)):
                self.table.setItem(row, column, QTableWidgetItem(text))
        self._update_delete_button()

    def selected(self) -> InstalledModel | None:
        row = self.table.currentRow()
        return self.installed[row] if 0 <= row < len(self.installed) else None

    def selected_path(self) -> str | None:
        model = self.selected()
        return model.path if model is not None and not model.missing else None

    def _choose_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Import a model folder")
        if folder:
            self.import_model(folder)

    def _choose_file(self) -> None:
        path = choose_model_file(self)
        if path:
            self.import_model(path)

    def import_model(self, path: str) -> None:
        """Check a folder or GGUF file in a child process, then register it (asking which file where
        a folder holds several); the outcome goes to `sig_message`."""
        self.sig_message.emit(f"Checking {path}…")
        ModelImporter(self.library, self, self._imported, self.sig_message.emit).start(path)

    def _imported(self, model: InstalledModel) -> None:
        self.refresh()
        self.sig_message.emit(f"Imported {model.name}.")
        self.sig_changed.emit()

    def delete(self, model: InstalledModel) -> None:
        """Delete a download or forget an imported folder, after asking."""
        imported = model.source == "imported"
        what = "forget this imported folder (its files stay)" if imported else "delete its files"
        answer = QMessageBox.question(self, "Delete model", f"{model.name}: {what}?")
        if answer != QMessageBox.StandardButton.Yes:
            return
        try:
            self.library.delete(model)
        except (OSError, ValueError) as err:
            self.sig_message.emit(f"Not deleted: {err}")
            return
        self.refresh()
        self.sig_message.emit(f"Forgot {model.name}." if imported else f"Deleted {model.name}.")
        self.sig_changed.emit()

    def _delete_selected(self) -> None:
        model = self.selected()
        if model is not None and model.deletable:
            self.delete(model)

    def _update_delete_button(self) -> None:
        model = self.selected()
        self.delete_button.setEnabled(model is not None and model.deletable)
