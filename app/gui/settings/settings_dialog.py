"""The settings dialog, built from `app.settings.fields.FIELDS`.

Each field gets the editor its kind calls for (a combo box for choices, a spin
box for numbers, a line edit for text, a line edit with "Browse…" for
folders), its explanation as a tooltip and its summary as a visible help line.
Apply and OK validate first; an invalid value is shown inline, on the field's
help line and under the form, and the dialog stays open. Valid settings go out
through `sig_applied`; the owner decides what to do with them (reload the
model when `needs_reload` says so, save them).

The form scrolls inside a dialog sized to its screen. The simulated link is
named as everywhere else (`engine_state`): without a GPU the link is simulated
whatever its speed, so its "no limit" value reads "unlimited", never "off".

"Re-tune for this GPU…" emits `sig_tune_requested`. It starts disabled, with a
tooltip saying why, until the owner wires a tuning wizard and calls
`set_tune_available(True)`.
"""

from __future__ import annotations

import logging
from typing import Any

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QPalette, QShowEvent
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.gui.engine.engine_state import SIMULATED_LINK_SETTING, SIMULATED_LINK_UNLIMITED
from app.gui.widgets.window_state import available_geometry, frame_margins
from app.settings import AppSettings, SettingsError
from app.settings.app_settings import needs_reload
from app.settings.fields import FIELDS, RELOAD_FIELDS, FieldInfo
from app.settings.remotes import RemoteStore

log = logging.getLogger(__name__)

ERROR_COLOR = "#c5221f"
TUNE_UNAVAILABLE = "The hardware auto-tune wizard is not available in this version yet."
TUNE_AVAILABLE = "Measure this machine and choose the cutoff layer, draft length and expert budget."
SIM_LINK_WITH_GPU = "A GPU is present: experts cross the real PCIe link, so no link is simulated."


class _Editor(QObject):
    """One field's editor: its widget, its value, and a signal when the user changes it."""

    sig_changed = Signal()
    """The user changed the value."""

    def __init__(self, name: str, info: FieldInfo, parent: QWidget):
        super().__init__(parent)
        self.name, self.info = name, info
        self.widget = self._make(parent)
        self.widget.setToolTip(info.help)

    def _make(self, parent: QWidget) -> QWidget:
        info = self.info
        if info.kind == "choice":
            self.combo = QComboBox(parent)
            for value, label in info.choices:
                self.combo.addItem(label, value)
            self.combo.currentIndexChanged.connect(self.sig_changed)
            return self.combo
        if info.kind == "int":
            self.spin = QSpinBox(parent)
            low = int(info.minimum or 0)
            self.spin.setRange(low - 1 if info.optional else low, int(info.maximum or 1_000_000))
            if info.optional:  # one below the minimum stands for None, shown as the placeholder
                self.spin.setSpecialValueText(info.placeholder or "auto")
            self.spin.valueChanged.connect(self.sig_changed)
            return self.spin
        if info.kind == "float":
            self.spin = QDoubleSpinBox(parent)
            self.spin.setDecimals(1)
            self.spin.setRange(info.minimum or 0.0, info.maximum or 1e6)
            self.spin.setSpecialValueText(info.placeholder or "off")  # shown at the minimum: None
            self.spin.valueChanged.connect(self.sig_changed)
            return self.spin
        self.line = QLineEdit(parent)
        self.line.setPlaceholderText(info.placeholder)
        self.line.textChanged.connect(self.sig_changed)
        if info.kind != "folder":
            return self.line
        box = QWidget(parent)
        row = QHBoxLayout(box)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.line, 1)
        self.browse = QPushButton("Browse…", box)
        self.browse.clicked.connect(self._browse)
        row.addWidget(self.browse)
        return box

    def value(self) -> Any:
        kind = self.info.kind
        if kind == "choice":
            return self.combo.currentData()
        if kind == "int":
            return (
                None if self.info.optional and self.spin.value() == self.spin.minimum() else self.spin.value()
            )
        if kind == "float":
            return (
                None if self.spin.value() == self.spin.minimum() and self.info.optional else self.spin.value()
            )
        text = self.line.text().strip()
        if kind == "folder":
            return text or None
        return text or self.info.placeholder

    def set_value(self, value: Any) -> None:
        kind = self.info.kind
        if kind == "choice":
            index = self.combo.findData(value)
            self.combo.setCurrentIndex(max(index, 0))
        elif kind == "int":
            self.spin.setValue(self.spin.minimum() if value is None else int(value))
        elif kind == "float":
            self.spin.setValue(self.spin.minimum() if value is None else float(value))
        else:
            self.line.setText("" if value is None else str(value))

    def focus(self) -> None:
        target = {"choice": "combo", "int": "spin", "float": "spin"}.get(self.info.kind, "line")
        getattr(self, target).setFocus()

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self.widget, self.info.title, self.line.text())
        if folder:
            self.line.setText(folder)


class SettingsDialog(QDialog):
    """Edit `AppSettings`; valid settings are emitted by `sig_applied` on Apply and on OK."""

    sig_applied = Signal(object)
    """The user applied valid settings (the new `AppSettings`)."""
    sig_tune_requested = Signal()
    """The user asked to re-tune the engine for this machine's GPU (the tuning wizard's job)."""
    sig_engine_chosen = Signal(object)
    """The user applied another engine: a saved remote's name, or None for this computer's."""
    sig_remotes_requested = Signal()
    """The user asked to add or edit remote engines (the model picker's Remote tab)."""

    def __init__(
        self,
        settings: AppSettings,
        parent: QWidget | None = None,
        gpu_available: bool = False,
        remotes: RemoteStore | None = None,
    ):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setMinimumWidth(min(680, available_geometry(parent).width() - 40))
        self._applied = settings
        self._gpu_available = gpu_available
        self._editors: dict[str, _Editor] = {}
        self._help: dict[str, QLabel] = {}
        self._error: SettingsError | None = None
        self.page = QWidget(self)
        groups = QVBoxLayout(self.page)
        groups.setContentsMargins(0, 0, 0, 0)
        self.engine = QComboBox(objectName="engineChoice")  # filled when there is a remote store
        if remotes is not None:
            groups.addWidget(self._engine_group(remotes))
        groups.addWidget(self._group("Model  (changing these loads the model again)", RELOAD_FIELDS))
        groups.addWidget(self._group("Replies", [n for n in FIELDS if n not in RELOAD_FIELDS]))
        self.scroll = QScrollArea(self, widgetResizable=True, frameShape=QScrollArea.Shape.NoFrame)
        self.scroll.setWidget(self.page)
        layout = QVBoxLayout(self)
        layout.addWidget(self.scroll, 1)
        self.error_label = QLabel(self)
        self.error_label.setWordWrap(True)
        self.error_label.setStyleSheet(f"color: {ERROR_COLOR}; font-weight: bold;")
        self.error_label.hide()
        layout.addWidget(self.error_label)
        self.reload_note = QLabel("", self)
        self.reload_note.setWordWrap(True)
        self.reload_note.setEnabled(False)  # greyed: a note, not a control; a line of its own
        layout.addWidget(self.reload_note)
        layout.addLayout(self._buttons())
        # Without a GPU the link is simulated whatever its speed: its "no limit" is not "off".
        self._editors["sim_link_gbps"].spin.setSpecialValueText(SIMULATED_LINK_UNLIMITED)
        self._set_editors(settings)
        for editor in self._editors.values():
            editor.sig_changed.connect(self._on_changed)
        self._on_changed()

    def _group(self, title: str, names) -> QGroupBox:
        group = QGroupBox(title, self)
        form = QFormLayout(group)
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        for name in names:
            info = FIELDS[name]
            editor = _Editor(name, info, group)
            help_line = QLabel(info.summary, group)
            help_line.setWordWrap(True)
            help_line.setToolTip(info.help)
            help_line.setForegroundRole(QPalette.ColorRole.PlaceholderText)  # a note, quieter than the field
            font = help_line.font()
            font.setPointSizeF(font.pointSizeF() * 0.9)
            help_line.setFont(font)
            cell = QWidget(group)
            column = QVBoxLayout(cell)
            column.setContentsMargins(0, 0, 0, 4)
            column.setSpacing(1)
            column.addWidget(editor.widget)
            column.addWidget(help_line)
            label = QLabel(info.title + ":", group)
            label.setToolTip(info.help)
            form.addRow(label, cell)
            self._editors[name], self._help[name] = editor, help_line
        return group

    def _engine_group(self, remotes: RemoteStore) -> QGroupBox:
        """Which engine answers: this computer's, or a saved remote (edited on the picker's Remote tab)."""
        group = QGroupBox("Engine", self)
        row = QHBoxLayout(group)
        self.engine.addItem("This computer (the local engine)", None)
        for endpoint in remotes.remotes():
            self.engine.addItem(f"{endpoint.name} — {endpoint.base_url}", endpoint.name)
        active = remotes.active()
        self.engine.setCurrentIndex(max(0, self.engine.findData(active.name if active else None)))
        self._engine_applied = self.engine.currentData()
        manage = QPushButton("Remote engines…", group)
        manage.clicked.connect(lambda: (self.reject(), self.sig_remotes_requested.emit()))
        row.addWidget(self.engine, 1)
        row.addWidget(manage)
        return group

    def _buttons(self) -> QHBoxLayout:
        row = QHBoxLayout()
        self.tune_button = QPushButton("Re-tune for this GPU…", self)
        self.tune_button.clicked.connect(self.sig_tune_requested)
        self.set_tune_available(False)
        row.addWidget(self.tune_button)
        row.addStretch(1)
        self.button_box = QDialogButtonBox(
            QDialogButtonBox.StandardButton.RestoreDefaults
            | QDialogButtonBox.StandardButton.Apply
            | QDialogButtonBox.StandardButton.Cancel
            | QDialogButtonBox.StandardButton.Ok,
            self,
        )
        self.button_box.clicked.connect(self._on_button)
        row.addWidget(self.button_box)
        return row

    # -- public ---------------------------------------------------------------------------------

    def settings(self) -> AppSettings:
        """The settings the editors show now (not validated)."""
        return AppSettings(**{name: editor.value() for name, editor in self._editors.items()})

    def set_tune_available(self, available: bool) -> None:
        """Enable "Re-tune for this GPU…" once something answers `sig_tune_requested`."""
        self.tune_button.setEnabled(available)
        self.tune_button.setToolTip(TUNE_AVAILABLE if available else TUNE_UNAVAILABLE)

    def error_text(self) -> str:
        """The inline error shown now ('' when none)."""
        return self.error_label.text() if not self.error_label.isHidden() else ""

    def apply(self) -> bool:
        """Validate; emit `sig_applied` and return True when valid, else show the error inline."""
        settings = self.settings()
        try:
            settings.validate(check_folders=True)
        except SettingsError as err:
            self._show_error(err)
            return False
        self._show_error(None)
        self._applied = settings
        self._on_changed()
        self.sig_applied.emit(settings)
        if self.engine.count() and self.engine.currentData() != self._engine_applied:
            self._engine_applied = self.engine.currentData()
            self.sig_engine_chosen.emit(self._engine_applied)
        return True

    def accept(self) -> None:
        if self.apply():
            super().accept()

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self._fit_height()

    def _fit_height(self) -> None:
        """Grow to show every wrapped help line (a window's minimum size ignores height-for-width),
        up to the screen's height; past it the form scrolls."""
        for group in self.findChildren(QGroupBox):  # a changed help line left their sizes stale
            group.layout().activate()
        self.page.layout().activate()
        self.layout().activate()
        page_height = self.page.layout().totalHeightForWidth(self.scroll.viewport().width())
        needed = self.height() - self.scroll.viewport().height() + page_height
        available = available_geometry(self)
        margins = frame_margins(self)
        room = available.height() - margins.top() - margins.bottom()
        height = min(max(needed, self.height()), room)
        if height != self.height():
            self.resize(min(self.width(), available.width() - margins.left() - margins.right()), height)
        frame_height = height + margins.top() + margins.bottom()
        top = max(available.top(), min(self.y(), available.bottom() + 1 - frame_height))
        if top != self.y():  # a window's y() is its frame's
            self.move(self.x(), top)

    # -- internals ------------------------------------------------------------------------------

    def _on_button(self, button) -> None:
        role = self.button_box.standardButton(button)
        if role == QDialogButtonBox.StandardButton.Ok:
            self.accept()
        elif role == QDialogButtonBox.StandardButton.Apply:
            self.apply()
        elif role == QDialogButtonBox.StandardButton.Cancel:
            self.reject()
        elif role == QDialogButtonBox.StandardButton.RestoreDefaults:
            self._set_editors(AppSettings())

    def _set_editors(self, settings: AppSettings) -> None:
        for name, editor in self._editors.items():
            editor.set_value(getattr(settings, name))

    def _on_changed(self) -> None:
        spec_mode = self._editors["spec_mode"].value()
        # `auto` drafts with a draft model given here too (else the model's own drafter)
        self._editors["draft_model"].widget.setEnabled(spec_mode in ("draft", "auto"))
        self._editors["draft_len"].widget.setEnabled(spec_mode != "none")
        sim_link = self._editors["sim_link_gbps"]
        sim_link.widget.setEnabled(not self._gpu_available)
        if self._gpu_available:
            sim_link.widget.setToolTip(f"{SIM_LINK_WITH_GPU}\n\n{FIELDS['sim_link_gbps'].help}")
        self._refresh_help()
        reload = needs_reload(self._applied, self.settings())
        self.reload_note.setText("Applying loads the model again." if reload else "")

    def _refresh_help(self) -> None:
        """Each field's help line: its summary, or the reason it is invalid after a failed apply."""
        for name, label in self._help.items():
            invalid = self._error is not None and self._error.field == name
            if invalid:
                text = self._error.reason
            elif name == "sim_link_gbps":
                text = SIM_LINK_WITH_GPU if self._gpu_available else SIMULATED_LINK_SETTING
            else:
                text = FIELDS[name].summary
            label.setText(text)
            label.setStyleSheet(f"color: {ERROR_COLOR};" if invalid else "")
            label.setEnabled(invalid or self._editors[name].widget.isEnabled())

    def _show_error(self, err: SettingsError | None) -> None:
        self._error = err
        self._refresh_help()
        self.error_label.setText(str(err) if err is not None else "")
        self.error_label.setVisible(err is not None)
        if err is not None:
            self._editors[err.field].focus()
            self._fit_height()
            log.info("Settings not applied: %s", err)
