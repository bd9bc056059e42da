"""The model picker: the catalog with fit estimates, Hub search, downloads and local folders.

`ModelPicker(QDialog)` has three tabs. Catalog: every supported release with its format and
quant, size, licence, expected fit on this computer (colour-coded), install state, and per row
Download / Cancel / Retry / Delete with a progress line (bytes, speed, ETA); a GGUF row fetches
only its own file, and a "coming" row shows why it cannot be used yet instead of a Download.
Search the Hub: a query, results of supported architectures, Download. Local folders: the
installed models and Import….
"Use this model" (or a double-click on an installed model) emits `sig_model_chosen(path)`
(a folder, or a GGUF file in a subfolder of its download).

Downloads belong to the `DownloadManager` passed in (the main window's, so they outlive the
dialog); a picker that made its own stops its downloads when it closes. Searches, imports and
token checks block, so they run on a worker thread (`picker_widgets.BackgroundCall`) and
report back on the GUI thread. Nothing here imports torch or safetensors.

A failure (a download, a search, a token) is one sentence shown in full in the `ErrorPanel` under
the tabs, with its details behind "Details…"; a row's status cell only starts it. The dialog fits
the screen it opens on (down to 1024×600): it is never larger than the available geometry, and
the columns the user acts on (model, fit, status, its buttons) come first and shrink last.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QSize, Signal
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.catalog import (
    CatalogEntry,
    estimate_fit,
    format_bytes,
    gpu_memory_bytes,
    load_catalog,
    system_ram_bytes,
)
from app.gui.models.background import BackgroundCall
from app.gui.models.downloads import DownloadManager, DownloadProgress, DownloadState
from app.gui.models.hub_client import load_token, store_token
from app.gui.models.hub_search_page import HubSearchPage
from app.gui.models.picker_widgets import (
    NBSP,
    DownloadRow,
    LocalModelsPage,
    catalog_cells,
    cell_text,
    fitted_widths,
    make_table,
    status_label,
)
from app.gui.models.remote_page import RemotePage
from app.gui.widgets.error_panel import ErrorPanel, error_details
from app.gui.widgets.window_state import available_geometry, fit_to_screen  # tests replace available_geometry
from app.model_library import ModelLibrary, ModelSource
from app.settings.remotes import RemoteStore

log = logging.getLogger(__name__)

FIT_COLOURS = {"good": "#1b7f3b", "tight": "#9a6700", "no": "#b3261e"}
# What the user acts on first (it stays in view on a narrow screen), then what describes the release.
CATALOG_COLUMNS = (
    "Model",
    "Parameters",
    "Format",
    "Download",
    "Fit on this computer",
    "Status",
    "",
    "Experts",
    "Architecture",
    "Licence",
)
FIT_COLUMN, STATUS_COLUMN = CATALOG_COLUMNS.index("Fit on this computer"), CATALOG_COLUMNS.index("Status")
COMING_COLOUR = "#9a6700"
CATALOG_WIDTHS = (270, 95, 85, 80, 260, 210, 100, 90, 95, 95)
CATALOG_MIN_WIDTHS = (190, 85, 85, 70, 205, 130, 100, 85, 90, 85)
ROW_HEIGHT = 54
PREFERRED_SIZE = QSize(1420, 760)
SCROLLBAR_ROOM = 40  # the table's frame and vertical scrollbar, and the page's margins


class ModelPicker(QDialog):
    sig_model_chosen = Signal(str)
    """The user chose a model: its local folder (the demo's folder for the demo)."""
    sig_engine_chosen = Signal(object)
    """The user chose an engine on the Remote tab: a saved remote's name, or None for the local one."""

    def __init__(
        self,
        parent: QWidget | None = None,
        manager: DownloadManager | None = None,
        library: ModelLibrary | None = None,
        vram_bytes: int | None = None,
        remotes: RemoteStore | None = None,
    ):
        super().__init__(parent)
        self.remotes = remotes if remotes is not None else RemoteStore()
        self.setWindowTitle("Models")
        self.library = library or (manager.library if manager is not None else ModelLibrary())
        self._owns_manager = manager is None
        self.manager = manager or DownloadManager(self, library=self.library)
        self.catalog = load_catalog()
        self.ram_bytes = system_ram_bytes()
        self.vram_bytes = vram_bytes if vram_bytes is not None else gpu_memory_bytes()
        self._rows: dict[str, list[DownloadRow]] = {}
        self._error_key: str | None = None  # the download whose failure the error panel shows
        self._build()
        self.manager.sig_progress.connect(self._on_progress)
        self.manager.sig_finished.connect(self._on_installed_changed)
        self.manager.sig_failed.connect(self._on_failed)
        self.manager.sig_cancelled.connect(self._on_installed_changed)
        # the preferred size, cut to the free area of the screen it opens on, frame included
        fit_to_screen(self, PREFERRED_SIZE, available_geometry(self.parentWidget() or self))

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        width = self.tabs.width() - SCROLLBAR_ROOM
        for column, column_width in enumerate(fitted_widths(CATALOG_WIDTHS, CATALOG_MIN_WIDTHS, width)):
            self.catalog_table.setColumnWidth(column, column_width)
        self.search_page.fit_columns(width)

    # -- building -------------------------------------------------------------------------------

    def _build(self) -> None:
        self.machine_label = QLabel(self._machine_text())
        self.machine_label.setWordWrap(True)
        self.tabs = QTabWidget()
        self.catalog_table = self._table(CATALOG_COLUMNS, CATALOG_WIDTHS)
        self.local_page = LocalModelsPage(self.library)
        self.local_page.sig_message.connect(self._say)
        self.local_page.sig_changed.connect(self._on_library_changed)
        self.local_page.table.itemSelectionChanged.connect(self._update_use_button)
        self.local_page.table.cellDoubleClicked.connect(lambda *_: self._use_selected())
        self.tabs.addTab(self.catalog_table, "Catalog")
        self.search_page = HubSearchPage(
            lambda: self.manager.endpoint, self._add_download_row, self._forget_search_rows, ROW_HEIGHT
        )
        self.search_page.sig_failed.connect(lambda error: self.show_error(str(error), error_details(error)))
        self.search_page.table.itemSelectionChanged.connect(self._update_use_button)
        self.search_page.table.cellDoubleClicked.connect(lambda *_: self._use_selected())
        self.search_box, self.search_table = self.search_page.search_box, self.search_page.table
        self.search_status = self.search_page.status
        self.tabs.addTab(self.search_page, "Search the Hub")
        self.tabs.addTab(self.local_page, "On this computer")
        self.remote_page = RemotePage(self.remotes)
        self.remote_page.sig_engine_chosen.connect(self._use_engine)
        self.tabs.addTab(self.remote_page, "Remote")
        self.error_panel = ErrorPanel()
        self.message_label = QLabel()
        self.message_label.setWordWrap(True)
        token_button = QPushButton("Hugging Face token…")
        token_button.clicked.connect(self._ask_token)
        self.use_button = QPushButton("Use this model")
        self.use_button.setDefault(True)
        self.use_button.clicked.connect(self._use_selected)
        close_button = QPushButton("Close")
        close_button.clicked.connect(self.reject)
        buttons = QHBoxLayout()
        for widget in (token_button, self.message_label):
            buttons.addWidget(widget)
        buttons.addStretch(1)
        buttons.addWidget(self.use_button)
        buttons.addWidget(close_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.machine_label)
        layout.addWidget(self.tabs, 1)
        layout.addWidget(self.error_panel)
        layout.addLayout(buttons)
        self._fill_catalog()
        self.tabs.currentChanged.connect(lambda _: self._update_use_button())
        self._update_use_button()

    def _table(self, columns: tuple[str, ...], widths: tuple[int, ...]) -> QTableWidget:
        table = make_table(columns, widths, ROW_HEIGHT)
        table.itemSelectionChanged.connect(self._update_use_button)
        table.cellDoubleClicked.connect(lambda *_: self._use_selected())
        return table

    # -- catalog ----------------------------------------------------------------------------------

    def _fill_catalog(self) -> None:
        table = self.catalog_table
        table.setRowCount(len(self.catalog))
        for row, entry in enumerate(self.catalog):
            for name, text in catalog_cells(entry).items():
                item = QTableWidgetItem(text)
                item.setToolTip(entry.notes)
                table.setItem(row, CATALOG_COLUMNS.index(name), item)
            if entry.bundled:
                table.setCellWidget(row, STATUS_COLUMN, status_label("Bundled with the app: ready to use"))
            elif entry.coming:  # listed, so the user learns why it is not offered yet
                cell = status_label(f"Coming: {entry.status_reason}", COMING_COLOUR, entry.notes)
                table.setCellWidget(row, STATUS_COLUMN, cell)
            else:
                self._add_download_row(table, row, STATUS_COLUMN, entry.source, entry.gated, "catalog")
        self._fill_fit()

    def _fill_fit(self) -> None:
        for row, entry in enumerate(self.catalog):
            fit = estimate_fit(entry, self.ram_bytes, self.vram_bytes)
            cell = status_label(f"● {fit.summary}", FIT_COLOURS[fit.level], f"{fit.summary}\n\n{entry.notes}")
            self.catalog_table.setCellWidget(row, FIT_COLUMN, cell)

    def set_vram_bytes(self, vram_bytes: int | None) -> None:
        """The GPU memory the worker reported; fit estimates follow it."""
        self.vram_bytes = vram_bytes
        self.machine_label.setText(self._machine_text())
        self._fill_fit()

    def _machine_text(self) -> str:
        gpu = f"GPU {format_bytes(self.vram_bytes)}" if self.vram_bytes else "no GPU found (CPU only)"
        return (
            f"This computer: {format_bytes(self.ram_bytes)} RAM, {gpu}. Fit estimates keep the experts "
            "in each release's own format (GGUF, BF16…) and the other weights in BF16."
        )

    def fit_text(self, entry_id: str) -> str:
        """The fit estimate shown for a catalog entry."""
        return cell_text(self.catalog_table.cellWidget(self._catalog_row(entry_id), FIT_COLUMN))

    def catalog_status_text(self, entry_id: str) -> str:
        """The status column of a bundled or "coming" catalog entry (a download's is `status_text`)."""
        return cell_text(self.catalog_table.cellWidget(self._catalog_row(entry_id), STATUS_COLUMN))

    def _catalog_row(self, entry_id: str) -> int:
        return next(i for i, e in enumerate(self.catalog) if e.id == entry_id)

    # -- download rows (catalog and search) --------------------------------------------------------

    def _add_download_row(
        self, table: QTableWidget, row: int, column: int, source: ModelSource, gated: bool, where: str
    ) -> DownloadRow:
        key = source.key
        download_row = DownloadRow(key, where)
        download_row.download_button.clicked.connect(lambda: self._download(source, gated))
        download_row.cancel_button.clicked.connect(lambda: self.manager.cancel(key))
        download_row.retry_button.clicked.connect(lambda: self._download(source, gated, retry=True))
        download_row.delete_button.clicked.connect(lambda: self._delete_download(key))
        table.setCellWidget(row, column, download_row.status)
        table.setCellWidget(row, column + 1, download_row.actions)
        self._rows.setdefault(key, []).append(download_row)
        self._refresh_row(download_row)
        return download_row

    def _refresh_row(self, download_row: DownloadRow) -> None:
        key = download_row.key
        download_row.show(
            self.manager.state(key),
            installed=self.library.is_installed(key),
            partial=self.library.has_partial(key),
        )

    def download_row(self, key: str, where: str = "catalog") -> DownloadRow:
        """The row widgets of download `key` in the catalog or in the search results."""
        return next(r for r in self._rows[key] if r.where == where)

    def status_text(self, key: str) -> str:
        """The status line the user sees for download `key` (its first row)."""
        return self._rows[key][0].status_label.text().replace(NBSP, " ")

    def row_buttons(self, key: str) -> list[str]:
        """The action buttons shown for download `key` (its first row)."""
        return self._rows[key][0].visible_buttons()

    def _on_progress(self, key: str, progress: DownloadProgress) -> None:
        for download_row in self._rows.get(key, ()):
            self._refresh_row(download_row)
        if key == self._error_key and progress.state is DownloadState.CHECKING:  # a Retry
            self.error_panel.clear()

    def _on_failed(self, key: str, reason: str) -> None:
        state = self.manager.state(key)
        self.show_error(f"{key} was not downloaded. {reason}", state.details if state else "")
        self._error_key = key
        self._on_installed_changed(key)

    def show_error(self, message: str, details: str = "") -> None:
        """Show a failure in full under the tabs, its details behind "Details…"."""
        self._error_key = None
        self.error_panel.show_error(message, details)

    def error_text(self) -> str:
        """The failure the error panel shows ("" when none)."""
        return self.error_panel.message()

    def _on_installed_changed(self, key: str, *_) -> None:
        for download_row in self._rows.get(key, ()):
            self._refresh_row(download_row)
        self.local_page.refresh()
        self._update_use_button()

    def _on_library_changed(self) -> None:
        for rows in self._rows.values():
            for download_row in rows:
                self._refresh_row(download_row)
        self._update_use_button()

    def _download(self, source: ModelSource, gated: bool, retry: bool = False) -> None:
        start = (lambda: self.manager.retry(source.key)) if retry else lambda: self.manager.start(source)
        if not gated or load_token():
            start()
            return
        token, ok = QInputDialog.getText(
            self,
            "Hugging Face token",
            f"{source.repo_id} is gated: accept its terms on huggingface.co, then paste an access token:",
            QLineEdit.EchoMode.Password,
        )
        if ok and token.strip():
            self._store_token_then(token, start)

    def _ask_token(self) -> None:
        token, ok = QInputDialog.getText(
            self, "Hugging Face token", "Access token for gated models:", QLineEdit.EchoMode.Password
        )
        if ok and token.strip():
            self._store_token_then(token, lambda: None)

    def _store_token_then(self, token: str, then) -> None:
        def stored(where: str) -> None:
            self._say(f"Token saved in {where}.")
            then()

        def failed(error: Exception) -> None:
            self._say("Token not saved.")
            self.show_error(f"The token was not saved. {error}", error_details(error))

        self._say("Saving the token…")
        BackgroundCall(lambda: store_token(token), stored, failed, owner=self).start()

    def _delete_download(self, key: str) -> None:
        model = self.library.find(key)
        if model is not None:
            self.local_page.delete(model)

    def search(self) -> None:
        """Search the Hub for the query in the search box (on a worker thread)."""
        self.search_page.search()

    def _forget_search_rows(self) -> None:
        for key, rows in self._rows.items():
            self._rows[key] = [r for r in rows if r.where != "search"]

    # -- choosing ----------------------------------------------------------------------------------

    def selected_model_path(self) -> str | None:
        """The folder of the installed model selected in the current tab, if any."""
        page = self.tabs.currentIndex()
        if page == 0:
            row = self.catalog_table.currentRow()
            return self._entry_path(self.catalog[row]) if 0 <= row < len(self.catalog) else None
        if page == 1:
            repo_id = self.search_page.selected_repo_id()
            model = self.library.find(repo_id) if repo_id is not None else None
            return model.path if model else None
        if self.tabs.currentWidget() is self.local_page:
            return self.local_page.selected_path()
        return None  # the Remote tab chooses engines, with its own buttons

    def _entry_path(self, entry: CatalogEntry) -> str | None:
        if entry.bundled:
            return entry.local_path
        path = None if entry.coming else self.library.installed_path(entry.source.key)
        return str(path) if path is not None else None

    def _use_selected(self) -> None:
        path = self.selected_model_path()
        if path is not None:
            self.sig_model_chosen.emit(path)
            self.accept()

    def _use_engine(self, name: str | None) -> None:
        self.sig_engine_chosen.emit(name)
        self.accept()

    def _update_use_button(self) -> None:
        self.use_button.setEnabled(self.selected_model_path() is not None)

    def _say(self, message: str) -> None:
        self.message_label.setText(message)

    def done(self, result: int) -> None:
        if self._owns_manager:
            self.manager.shutdown()  # nobody else would watch these downloads
        super().done(result)
