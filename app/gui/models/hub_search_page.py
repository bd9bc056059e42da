"""The model picker's "Search the Hub" tab: a query, the results of supported architectures, and a
download row per result (made by the picker, so the catalog and the results render a download the
same way).

The search runs on a worker thread (`BackgroundCall`). A failure (offline, refused, HTTP 429 …)
arrives as a `HubError` whose message is one sentence: the status line says the search failed and
`sig_failed(error)` hands the error to the picker, which shows it in full with its details.
The columns that let the user act (model, status, its buttons) come first, so they stay in view
on a narrow screen; the rest scrolls.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.catalog import format_params
from app.gui.models.background import BackgroundCall
from app.gui.models.hub_client import HubModel, search_models
from app.gui.models.picker_widgets import fitted_widths, make_table
from app.model_library import ModelSource

SEARCH_COLUMNS = ("Model", "Status", "", "Architecture", "Parameters", "Downloads", "Notes")
STATUS_COLUMN = SEARCH_COLUMNS.index("Status")
SEARCH_WIDTHS = (340, 270, 100, 100, 90, 100, 240)
SEARCH_MIN_WIDTHS = (220, 180, 100, 90, 80, 80, 120)
QUANTIZED_NOTE = "pre-quantized: cannot run"
HINT = "Only models of architectures MoE Chat supports are listed."


class HubSearchPage(QWidget):
    """The search tab (see the module docstring)."""

    sig_failed = Signal(object)
    """The search failed: the exception (a `HubError` for what a network can be expected to do)."""

    def __init__(
        self,
        endpoint: Callable[[], str | None],
        add_download_row: Callable,
        forget_download_rows: Callable[[], None],
        row_height: int,
        parent: QWidget | None = None,
    ):
        super().__init__(parent)
        self._endpoint, self._add_download_row = endpoint, add_download_row
        self._forget_download_rows = forget_download_rows  # the rows of the previous results
        self.results: list[HubModel] = []
        self.search_box = QLineEdit()
        self.search_box.setPlaceholderText("Search the Hugging Face Hub, e.g. Qwen3 MoE, Mixtral, OLMoE")
        self.search_box.returnPressed.connect(self.search)
        search_button = QPushButton("Search")
        search_button.clicked.connect(self.search)
        self.status = QLabel(HINT)
        self.status.setWordWrap(True)
        self.table = make_table(SEARCH_COLUMNS, SEARCH_WIDTHS, row_height)
        row = QHBoxLayout()
        row.addWidget(self.search_box, 1)
        row.addWidget(search_button)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.status)
        layout.addWidget(self.table, 1)

    def fit_columns(self, width: int) -> None:
        """Column widths for a table `width` pixels wide (the buttons first to stay in view)."""
        for column, column_width in enumerate(fitted_widths(SEARCH_WIDTHS, SEARCH_MIN_WIDTHS, width)):
            self.table.setColumnWidth(column, column_width)

    def search(self) -> None:
        """Search the Hub for the query in the search box (on a worker thread)."""
        query = self.search_box.text()
        self.status.setText(f"Searching the Hub for “{query}”…")
        endpoint = self._endpoint()
        work = lambda: search_models(query, endpoint=endpoint)  # noqa: E731
        BackgroundCall(work, self.show_results, self._failed, owner=self).start()

    def selected_repo_id(self) -> str | None:
        row = self.table.currentRow()
        return self.results[row].repo_id if 0 <= row < len(self.results) else None

    def _failed(self, error: Exception) -> None:
        self.status.setText("The search failed: see the message below.")
        self.sig_failed.emit(error)

    def show_results(self, results: list[HubModel]) -> None:
        self._forget_download_rows()
        self.results = results
        table = self.table
        table.setRowCount(len(results))
        for row, model in enumerate(results):
            params = format_params(model.total_params) if model.total_params else "unknown"
            notes = [note for note, on in (("gated", model.gated), (QUANTIZED_NOTE, model.quantized)) if on]
            cells = {
                "Model": model.repo_id,
                "Architecture": model.architecture,
                "Parameters": params,
                "Downloads": f"{model.downloads:,}",
                "Notes": ", ".join(notes),
            }
            for name, text in cells.items():
                table.setItem(row, SEARCH_COLUMNS.index(name), QTableWidgetItem(text))
            source = ModelSource(model.repo_id)
            download_row = self._add_download_row(table, row, STATUS_COLUMN, source, model.gated, "search")
            download_row.download_button.setEnabled(not model.quantized)
        count = f"{len(results)} model(s)" if results else "No models"
        self.status.setText(f"{count} of supported architectures found.")
