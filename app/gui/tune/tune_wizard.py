"""The hardware auto-tune wizard: detect, choose a budget, profile in the engine, show and apply.

`TuneWizard(client, settings)` walks through four pages: the detected hardware
(from `client.ready.device` and the latest Stats), the model and its expert
budget, the profiling run (`client.tune(...)`, answered by `sig_tune_progress`
and `sig_tune_result` or `sig_error` for its request id; Cancel and Retry), and
the result: measured TPOT (median and spread) against the prefetch cutoff layer per
drafter and draft length, with the engine's prediction dashed on the same axes
(`TuneCurvePlot`), the choice and the reasons. The engine stores the result for the
loaded model (and GPU, budget, precision), where it runs as that model's `auto`: "Apply"
emits `sig_apply` with the settings unchanged but for what the page says it changes —
speculation and prefetch left to each model's auto where the user ticks that
(`settings.with_tune()`), and a budget typed on page 2 (taking effect when the model is
reloaded).
The wizard never imports the engine's torch side: the result is a plain dict.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
    QWizard,
    QWizardPage,
)

from app.gui.tune.tune_plot import TuneCurvePlot
from app.gui.tune.tune_text import describe_apply, describe_choice, describe_probe, gib
from app.settings import AppSettings
from engine.config import ExpertBudget
from engine.errors import EngineError

log = logging.getLogger(__name__)

NO_GPU_TEXT = (
    "No GPU: the engine runs on the CPU with a simulated link; the tuning still works, "
    "and its figures are simulated."
)
STAGE_TEXT = {
    "probe": "Probing the device and the host→device link",
    "copy": "Timing expert copies",
    "layer": "Timing one layer's decode step",
    "draft": "Timing the drafter",
    "verify": "Timing verification passes",
    "memory": "Measuring peak memory",
    "acceptance": "Measuring the draft acceptance rate",
    "profile": "Measuring tokens per second at candidate settings",
    "search": "Searching for the best settings",
}
MIN_NEW_TOKENS, MAX_NEW_TOKENS = 8, 128


# ---- the pages ------------------------------------------------------------------------------------


def _wrapped(text: str, parent: QWidget) -> QLabel:
    label = QLabel(text, parent)
    label.setWordWrap(True)
    return label


class HardwarePage(QWizardPage):
    """Page 1: what the engine runs on, and the host's memory."""

    def __init__(self, client, stats=None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setTitle("Detected hardware")
        self.setSubTitle("The auto-tune measures this machine and picks the fastest settings for it.")
        self._client = client
        self.device_label = _wrapped("", self)
        self.memory_label = _wrapped("", self)
        self.note_label = _wrapped("", self)
        layout = QVBoxLayout(self)
        for label in (self.device_label, self.memory_label, self.note_label):
            layout.addWidget(label)
        layout.addStretch(1)
        client.sig_stats.connect(self.set_stats)
        self.set_stats(stats)

    def set_stats(self, stats) -> None:
        """Show the device from `client.ready` and the host RAM from the latest Stats (None: unknown)."""
        device = self._client.ready.device if self._client.ready is not None else None
        if device is None:
            self.device_label.setText("Device: the engine has not started yet.")
        elif device.kind == "cpu":
            self.device_label.setText(f"Device: CPU ({device.name})")
        else:
            self.device_label.setText(f"GPU: {device.name}, {gib(device.total_memory_bytes)} of memory")
        host_ram = getattr(stats, "host_ram_total_bytes", None)
        self.memory_label.setText(f"Host memory: {gib(host_ram)}")
        self.note_label.setText(NO_GPU_TEXT if device is not None and device.kind == "cpu" else "")
        self.note_label.setVisible(device is not None and device.kind == "cpu")


class BudgetPage(QWizardPage):
    """Page 2: the model, the expert memory budget, re-measuring and the calibration length."""

    def __init__(self, settings: AppSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.setTitle("Model and memory budget")
        self.setSubTitle("The tuning runs on the model that is loaded now.")
        self._settings = settings
        form = QFormLayout(self)
        form.addRow("Model:", QLabel(settings.model_path or "bundled demo model", self))
        self.budget_edit = QLineEdit(settings.expert_budget, self)
        self.budget_edit.setPlaceholderText("auto, all, 2GiB or 64")
        self.budget_edit.textChanged.connect(self._on_budget)
        form.addRow("Expert memory budget:", self.budget_edit)
        self.budget_error = _wrapped("", self)
        self.budget_error.setStyleSheet("color: #b00020;")
        form.addRow("", self.budget_error)
        self.retune_check = QCheckBox("Measure again even if a stored result exists", self)
        form.addRow("", self.retune_check)
        self.tokens_spin = QSpinBox(self)
        self.tokens_spin.setRange(MIN_NEW_TOKENS, MAX_NEW_TOKENS)
        self.tokens_spin.setValue(32)
        self.tokens_spin.setToolTip("Tokens generated per calibration prompt and measured point.")
        form.addRow("Calibration length (new tokens per point):", self.tokens_spin)
        self._on_budget()

    def budget(self) -> str:
        """The budget as typed (empty: the placeholder's auto)."""
        return self.budget_edit.text().strip() or "auto"

    def budget_changed(self) -> bool:
        """Whether the typed budget is a different one from the settings' (2GiB == 2 GiB)."""
        try:
            return ExpertBudget.parse(self.budget()) != ExpertBudget.parse(self._settings.expert_budget)
        except EngineError:
            return self.budget() != self._settings.expert_budget

    def isComplete(self) -> bool:
        try:
            ExpertBudget.parse(self.budget())
        except EngineError:
            return False
        return True

    def _on_budget(self) -> None:
        try:
            ExpertBudget.parse(self.budget())
            self.budget_error.setText("")
        except EngineError as err:
            self.budget_error.setText(str(err))
        self.budget_error.setVisible(bool(self.budget_error.text()))
        self.completeChanged.emit()


class ProfilingPage(QWizardPage):
    """Page 3: runs `client.tune(...)` when entered; complete once the result has arrived."""

    def __init__(self, client, settings: AppSettings, budget_page: BudgetPage, parent: QWidget | None = None):
        super().__init__(parent)
        self.setTitle("Profiling")
        self.setSubTitle("The engine times copies, layers and drafts, then tries the best candidates.")
        self._client, self._settings, self._budget_page = client, settings, budget_page
        self.request_id: str | None = None
        self.result: dict[str, Any] | None = None
        self.budget_note = _wrapped("", self)
        self.stage_label = _wrapped("", self)
        self.progress = QProgressBar(self)
        self.error_label = _wrapped("", self)
        self.error_label.setStyleSheet("color: #b00020;")
        self.cancel_button = QPushButton("Cancel", self)
        self.cancel_button.clicked.connect(self.cancel)
        self.retry_button = QPushButton("Retry", self)
        self.retry_button.clicked.connect(self.start)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.retry_button)
        layout = QVBoxLayout(self)
        for widget in (self.budget_note, self.stage_label, self.progress, self.error_label):
            layout.addWidget(widget)
        layout.addLayout(buttons)
        layout.addStretch(1)
        client.sig_tune_progress.connect(self._on_progress)
        client.sig_tune_result.connect(self._on_result)
        client.sig_error.connect(self._on_error)

    def initializePage(self) -> None:
        budget = self._budget_page.budget()
        if self._budget_page.budget_changed():
            self.budget_note.setText(
                f"The new budget ({budget}) will be applied and the model reloaded after Apply. This "
                f"tuning measures the model as it is loaded now (budget {self._settings.expert_budget})."
            )
        else:
            self.budget_note.setText(f"Tuning the loaded model with its expert budget ({budget}).")
        self.start()

    def cleanupPage(self) -> None:  # going Back stops the run
        self.stop()

    def start(self) -> None:
        """Ask the engine to tune (again); the previous request, if any, is cancelled first."""
        self.stop()
        self.result = None
        self.request_id = self._client.tune(
            draft_model=self._settings.draft_model,
            new_tokens=self._budget_page.tokens_spin.value(),
            retune=self._budget_page.retune_check.isChecked(),
        )
        log.info("auto-tune started (request %s)", self.request_id)
        self._show_state("Starting…", error="")
        self.progress.setRange(0, 0)  # busy until the first progress event
        self.completeChanged.emit()

    def cancel(self) -> None:
        """Stop the running tune; Retry starts it again."""
        self.stop()
        self._show_state("Cancelled.", error="")
        self.progress.setRange(0, 1)
        self.progress.setValue(0)

    def stop(self) -> None:
        """Cancel the request in flight, if there is one (nothing is shown)."""
        if self.request_id is not None and self.result is None:
            self._client.cancel(self.request_id)
        self.request_id = None

    def isComplete(self) -> bool:
        return self.result is not None

    def _show_state(self, stage: str, error: str) -> None:
        running = self.request_id is not None and self.result is None
        self.stage_label.setText(stage)
        self.error_label.setText(error)
        self.error_label.setVisible(bool(error))
        self.cancel_button.setVisible(running)
        self.retry_button.setVisible(not running and self.result is None)

    def _on_progress(self, request_id: str, stage: str, done: int, total: int) -> None:
        if request_id != self.request_id:
            return
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(min(done, max(total, 1)))
        self._show_state(f"{STAGE_TEXT.get(stage, stage)} ({done} of {total})", error="")

    def _on_result(self, request_id: str, result: dict) -> None:
        if request_id != self.request_id:
            return
        self.result = result
        self.progress.setRange(0, 1)
        self.progress.setValue(1)
        self._show_state(
            "Done: press Next to see the result."
            if not result.get("reused")
            else "Done (a stored result for this machine and model): press Next.",
            error="",
        )
        self.completeChanged.emit()

    def _on_error(self, request_id: str, kind: str, message: str) -> None:
        if request_id != self.request_id:
            return
        log.warning("auto-tune failed (%s): %s", kind, message)
        self.request_id = None
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self._show_state("The tuning stopped.", error=f"{message} ({kind})")


class ResultPage(QWizardPage):
    """Page 4: the curves, the chosen settings, the reasons, the probe and whether it was reused."""

    def __init__(self, profiling_page: ProfilingPage, parent: QWidget | None = None):
        super().__init__(parent)
        self.setTitle("Result")
        self._profiling_page = profiling_page
        self.plot = TuneCurvePlot(self)
        self.choice_label = _wrapped("", self)
        self.choice_label.setTextFormat(Qt.TextFormat.RichText)
        self.reasons_label = _wrapped("", self)
        self.probe_label = _wrapped("", self)
        self.reused_label = _wrapped("", self)
        self.use_auto_check = QCheckBox("Leave speculation and prefetch to each model's auto", self)
        self.use_auto_check.toggled.connect(self._show_apply)
        self.apply_label = _wrapped("", self)
        # the words scroll under the plot, so the page and its buttons fit a 600-pixel-high screen
        words = QWidget(self)
        column = QVBoxLayout(words)
        column.setContentsMargins(0, 0, 0, 0)
        for label in (self.choice_label, self.use_auto_check, self.apply_label, self.reasons_label):
            column.addWidget(label)
        for label in (self.probe_label, self.reused_label):
            column.addWidget(label)
        column.addStretch(1)
        scroll = QScrollArea(self)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(words)
        layout = QVBoxLayout(self)
        layout.addWidget(self.plot, 3)
        layout.addWidget(scroll, 2)

    def initializePage(self) -> None:
        self.show_result(self._profiling_page.result or {})

    def show_result(self, result: dict[str, Any]) -> None:
        """Fill the page from a TuneResult dict, and say what Apply will change."""
        choice = result.get("choice", {})
        self.plot.set_data(
            list(result.get("measured", [])), list(result.get("prediction", {}).get("curve", [])), choice
        )
        self.choice_label.setText(describe_choice(choice))
        self._show_apply()
        reasons = result.get("prediction", {}).get("reasons", [])
        predicted = "Before measuring, a model of this machine predicted (the measured runs decided):"
        self.reasons_label.setText("\n".join([predicted, *(f"• {reason}" for reason in reasons)]))
        self.probe_label.setText(describe_probe(result.get("probe", {})))
        self.reused_label.setText(
            "Reused a stored result from an earlier run (tick “measure again” on page 2 to re-measure)."
            if result.get("reused")
            else "Measured just now."
        )

    def _show_apply(self) -> None:
        wizard = self.wizard()
        if not isinstance(wizard, TuneWizard):
            return
        settings, budget_page = wizard.settings, wizard.budget_page
        self.use_auto_check.setVisible(bool(settings.tune_blockers()))
        budget = budget_page.budget() if budget_page.budget_changed() else None
        self.apply_label.setText(describe_apply(settings, self.use_auto_check.isChecked(), budget))


# ---- the wizard -----------------------------------------------------------------------------------


class TuneWizard(QWizard):
    """Detect, choose a budget, profile in the engine, show the result; Apply emits the settings."""

    sig_apply = Signal(object)
    """The user applied the tune: the new AppSettings (the model needs a reload if the budget changed)."""

    def __init__(self, client, settings: AppSettings, parent: QWidget | None = None, stats=None):
        super().__init__(parent)
        self.setWindowTitle("Auto-tune for this machine")
        self.setWizardStyle(QWizard.WizardStyle.ClassicStyle)
        self.setButtonText(QWizard.WizardButton.FinishButton, "Apply")
        self.setMinimumSize(640, 480)  # fits a 1024×600 screen; the result's words scroll
        self._settings = settings
        self.hardware_page = HardwarePage(client, stats, self)
        self.budget_page = BudgetPage(settings, self)
        self.profiling_page = ProfilingPage(client, settings, self.budget_page, self)
        self.result_page = ResultPage(self.profiling_page, self)
        for page in (self.hardware_page, self.budget_page, self.profiling_page, self.result_page):
            self.addPage(page)

    @property
    def settings(self) -> AppSettings:
        return self._settings

    def tuned_settings(self) -> AppSettings | None:
        """The settings Apply gives, or None before a result has arrived: the same settings (the
        result is the loaded model's own `auto`, stored by the engine), with speculation and
        prefetch left to each model's auto where the user ticked that, and a budget typed on
        page 2 (it applies after a reload)."""
        if self.profiling_page.result is None:
            return None
        tuned = self._settings
        if self.result_page.use_auto_check.isChecked():
            tuned = tuned.with_tune()
        if self.budget_page.budget_changed():
            tuned = replace(tuned, expert_budget=self.budget_page.budget())
        return tuned

    def accept(self) -> None:
        tuned = self.tuned_settings()
        if tuned is not None:
            self.sig_apply.emit(tuned)
        super().accept()

    def reject(self) -> None:
        self.profiling_page.stop()
        super().reject()
