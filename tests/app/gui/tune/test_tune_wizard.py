"""TuneWizard against a fake client: the flow, cancel, error and retry, Apply; with_tune; plot helpers."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QWizard

from app.gui.tune.tune_plot import (
    TuneCurvePlot,
    axis_ranges,
    nice_ticks,
    series_by_draft_len,
    series_by_drafter,
)
from app.gui.tune.tune_text import describe_apply, describe_choice
from app.gui.tune.tune_wizard import NO_GPU_TEXT, TuneWizard
from app.settings import AppSettings, SettingsError
from engine.generation_config import SamplingConfig
from engine.worker.protocol import DeviceInfo, Ready
from tests.screenshots import save_screenshot

RESULT = json.loads((Path(__file__).parent / "tune_result.json").read_text(encoding="utf-8"))


class FakeClient(QObject):
    """EngineClient's tune side: the same signals, `tune` and `cancel` recorded, no worker."""

    sig_stats = Signal(object)
    sig_tune_progress = Signal(str, str, int, int)
    sig_tune_result = Signal(str, dict)
    sig_error = Signal(str, str, str)
    sig_ready = Signal(object)

    def __init__(self, kind: str = "cpu"):
        super().__init__()
        name = "x86_64" if kind == "cpu" else "NVIDIA GeForce RTX 4090"
        memory = None if kind == "cpu" else 24 * 2**30
        self.ready = Ready("", 2, 1, DeviceInfo(kind, name, memory, "2.5"))
        self.tunes: list[dict] = []
        self.cancelled: list[str] = []

    def tune(self, draft_model=None, new_tokens: int = 32, retune: bool = False) -> str:
        self.tunes.append({"draft_model": draft_model, "new_tokens": new_tokens, "retune": retune})
        return f"tune-{len(self.tunes)}"

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def _wizard(qtbot, client: FakeClient, settings: AppSettings | None = None) -> TuneWizard:
    wizard = TuneWizard(client, settings or AppSettings())
    qtbot.addWidget(wizard)
    wizard.show()
    return wizard


def _to_profiling(wizard: TuneWizard) -> None:
    wizard.next()
    wizard.next()
    assert wizard.currentPage() is wizard.profiling_page


def _finish(wizard: TuneWizard, client: FakeClient, request_id: str) -> None:
    for done, stage in enumerate(("probe", "copy", "layer", "search"), start=1):
        client.sig_tune_progress.emit(request_id, stage, done, 4)
    client.sig_tune_result.emit(request_id, RESULT)


@pytest.mark.gui
def test_hardware_page_says_no_gpu(qtbot):
    wizard = _wizard(qtbot, FakeClient("cpu"))
    page = wizard.hardware_page
    assert page.note_label.text() == NO_GPU_TEXT and page.note_label.isVisible()
    assert page.memory_label.text() == "Host memory: unknown"
    wizard.hardware_page.set_stats(type("Stats", (), {"host_ram_total_bytes": 64 * 2**30})())
    assert page.memory_label.text() == "Host memory: 64.0 GiB"


@pytest.mark.gui
def test_hardware_page_shows_the_gpu(qtbot):
    wizard = _wizard(qtbot, FakeClient("cuda"))
    assert "RTX 4090" in wizard.hardware_page.device_label.text()
    assert "24.0 GiB" in wizard.hardware_page.device_label.text()
    assert not wizard.hardware_page.note_label.isVisible()


@pytest.mark.gui
def test_flow_progress_result_and_apply(qtbot, tmp_path):
    client = FakeClient()
    wizard = _wizard(qtbot, client, AppSettings(spec_mode="draft", draft_len=3))
    wizard.next()
    wizard.budget_page.tokens_spin.setValue(16)
    wizard.budget_page.retune_check.setChecked(True)
    wizard.next()
    assert client.tunes == [{"draft_model": None, "new_tokens": 16, "retune": True}]
    page = wizard.profiling_page
    assert not page.isComplete() and page.cancel_button.isVisible()
    client.sig_tune_progress.emit("tune-1", "layer", 2, 5)
    assert page.progress.value() == 2 and page.progress.maximum() == 5
    assert "layer" in page.stage_label.text() and "2 of 5" in page.stage_label.text()
    client.sig_tune_progress.emit("other", "copy", 9, 9)  # another request's: ignored
    assert page.progress.value() == 2
    _finish(wizard, client, "tune-1")
    assert page.isComplete() and not page.cancel_button.isVisible()
    wizard.next()
    result_page = wizard.result_page
    assert wizard.currentPage() is result_page
    choice = RESULT["choice"]
    text = result_page.choice_label.text()
    assert "draft length 4 with the draft model" in text and "cutoff layer 2 (SP-MoE prefetch" in text
    assert f"expected {choice['expected_tokens_per_s']:.1f} tokens/s" in text
    assert choice["certainty"].startswith("Sure:") and html.escape(choice["certainty"]) in text
    assert " won at " in choice["why"] and html.escape(choice["why"]) in text  # why, in one sentence
    assert "simulated link" in result_page.probe_label.text()
    assert result_page.reused_label.text() == "Measured just now."
    reasons = result_page.reasons_label.text()  # the analytic model's words, per drafter
    assert all(name in reasons for name in ("The draft model:", "Self-speculation", "Substitute experts"))
    assert wizard.button(QWizard.WizardButton.FinishButton).text() == "Apply"
    # the settings fix speculation for every model: said before Apply, and changed only when ticked
    assert result_page.use_auto_check.isVisible() and not result_page.use_auto_check.isChecked()
    assert "fix speculation (draft)" in result_page.apply_label.text()
    assert wizard.tuned_settings() == AppSettings(spec_mode="draft", draft_len=3)
    result_page.use_auto_check.setChecked(True)
    assert "Apply sets speculation (draft) to auto" in result_page.apply_label.text()
    _screenshot(wizard, tmp_path)
    with qtbot.waitSignal(wizard.sig_apply) as applied:
        wizard.button(QWizard.WizardButton.FinishButton).click()
    settings = applied.args[0]
    # the budget, draft length and policy stay the user's; the choice runs as the model's auto
    assert settings == AppSettings(spec_mode="auto", draft_len=3)


def _screenshot(wizard: TuneWizard, tmp_path: Path) -> None:
    wizard.resize(900, 760)
    save_screenshot(wizard, "tune-wizard.png", tmp_path)  # docs/screenshots/tune-wizard.png


@pytest.mark.gui
def test_changed_budget_is_announced_and_applied(qtbot):
    client = FakeClient()
    wizard = _wizard(qtbot, client)
    wizard.next()
    wizard.budget_page.budget_edit.setText("nonsense")
    assert not wizard.budget_page.isComplete() and wizard.budget_page.budget_error.text()
    wizard.budget_page.budget_edit.setText("2GiB")
    assert wizard.budget_page.isComplete() and not wizard.budget_page.budget_error.text()
    wizard.next()
    assert "reloaded after Apply" in wizard.profiling_page.budget_note.text()
    _finish(wizard, client, "tune-1")
    wizard.next()
    with qtbot.waitSignal(wizard.sig_apply) as applied:
        wizard.accept()
    assert applied.args[0].expert_budget == "2GiB"


@pytest.mark.gui
def test_cancel_calls_client_cancel_with_the_request_id(qtbot):
    client = FakeClient()
    wizard = _wizard(qtbot, client)
    _to_profiling(wizard)
    wizard.profiling_page.cancel_button.click()
    assert client.cancelled == ["tune-1"]
    assert wizard.profiling_page.retry_button.isVisible() and not wizard.profiling_page.isComplete()
    client.sig_tune_result.emit("tune-1", RESULT)  # a late answer to the cancelled request: ignored
    assert not wizard.profiling_page.isComplete()


@pytest.mark.gui
def test_error_shows_retry_and_retry_tunes_again(qtbot):
    client = FakeClient()
    wizard = _wizard(qtbot, client)
    _to_profiling(wizard)
    page = wizard.profiling_page
    assert not page.retry_button.isVisible()
    client.sig_error.emit("tune-1", "internal", "CUDA out of memory")
    assert page.error_label.isVisible() and "CUDA out of memory" in page.error_label.text()
    assert page.retry_button.isVisible() and not page.cancel_button.isVisible()
    page.retry_button.click()
    assert len(client.tunes) == 2 and page.request_id == "tune-2"
    assert not page.error_label.isVisible()
    _finish(wizard, client, "tune-2")
    assert page.isComplete()


@pytest.mark.gui
def test_closing_the_wizard_cancels_the_running_tune(qtbot):
    client = FakeClient()
    wizard = _wizard(qtbot, client)
    _to_profiling(wizard)
    wizard.reject()
    assert client.cancelled == ["tune-1"]


def test_a_tune_changes_no_setting_that_holds_for_every_model():
    """A tune result is its model's `auto` (stored per GPU, model, budget and precision): Apply
    writes no budget, draft length, policy or speculation mode that every other model would then
    run with, and says what it changes before it does."""
    settings = AppSettings(model_path="/models/qwen", expert_budget="auto", draft_len=5, policy="lfu")
    assert settings.tune_blockers() == {} and settings.with_tune() == settings
    assert describe_apply(settings, use_auto=False).startswith("Apply changes none of your settings")
    fixed = AppSettings(spec_mode="none", prefetch="spmoe", cutoff_layer=2, draft_len=5)
    assert fixed.tune_blockers() == {"spec_mode": "none", "prefetch": "spmoe", "cutoff_layer": "2"}
    assert fixed.with_tune() == AppSettings(draft_len=5)  # only what kept the choice from running
    said = describe_apply(fixed, use_auto=False)
    assert "fix speculation (none), prefetch (spmoe), the cutoff layer (2)" in said and "does not run" in said
    assert "Apply sets speculation (none)" in describe_apply(fixed, use_auto=True)
    assert "budget becomes 8GiB" in describe_apply(settings, False, budget="8GiB")


def test_cutoff_layer_setting_is_checked_and_reaches_the_generation_config():
    assert AppSettings().generation_config(SamplingConfig(), 8).cutoff is None
    assert AppSettings(cutoff_layer=-1).generation_config(SamplingConfig(), 8).cutoff == -1
    with pytest.raises(SettingsError) as info:
        AppSettings(cutoff_layer=-2).validate()
    assert info.value.field == "cutoff_layer"


def test_plot_helpers():
    groups = series_by_draft_len(RESULT["prediction"]["curve"])
    assert [x for x, _ in groups[2]] == sorted(x for x, _ in groups[2])
    (x0, x1), (y0, y1) = axis_ranges(RESULT["measured"], RESULT["prediction"]["curve"])
    assert (x0, x1) == (-1.5, 5.5)
    lows = [p.get("tpot_low_ms", p["tpot_ms"]) for p in RESULT["measured"]] + [
        p["tpot_ms"] for p in RESULT["prediction"]["curve"]
    ]
    highs = [p.get("tpot_high_ms", p["tpot_ms"]) for p in RESULT["measured"]] + [
        p["tpot_ms"] for p in RESULT["prediction"]["curve"]
    ]
    assert y0 <= min(lows) and y1 >= max(highs)  # the error bars fit too
    assert axis_ranges([], []) == ((-1.5, 1.5), (0.0, 1.0))
    assert nice_ticks(36.4, 61.4) == [35, 40, 45, 50, 55, 60, 65]
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(3.0, 3.0) == [3.0, 3.2, 3.4, 3.6, 3.8, 4.0]  # no span: one unit


def test_series_by_drafter_keeps_each_drafter_apart_with_its_spread():
    measured = [
        {
            "cutoff_layer": 1,
            "draft_len": 2,
            "tpot_ms": 5.0,
            "drafter": "self",
            "tpot_low_ms": 4.0,
            "tpot_high_ms": 7.0,
        },
        {
            "cutoff_layer": -1,
            "draft_len": 2,
            "tpot_ms": 6.0,
            "drafter": "draft",
            "tpot_low_ms": 5.5,
            "tpot_high_ms": 6.5,
        },
        {"cutoff_layer": -1, "draft_len": 0, "tpot_ms": 9.0, "drafter": ""},  # one run: no spread
        {
            "cutoff_layer": -1,
            "draft_len": 2,
            "tpot_ms": 8.0,
            "drafter": "self",
            "tpot_low_ms": 7.0,
            "tpot_high_ms": 9.0,
        },
    ]
    groups = series_by_drafter(measured)
    assert list(groups) == [("", 0), ("draft", 2), ("self", 2)]  # plain, the draft model, self
    assert groups[("", 0)] == [(-1, 9.0, 9.0, 9.0)]
    assert groups[("self", 2)] == [(-1, 8.0, 7.0, 9.0), (1, 5.0, 4.0, 7.0)]


@pytest.mark.gui
def test_plot_has_a_series_per_drafter_the_prediction_and_the_chosen_point(qtbot):
    plot = TuneCurvePlot()
    qtbot.addWidget(plot)
    plot.set_data(RESULT["measured"], RESULT["prediction"]["curve"], RESULT["choice"])
    labels = [label for label, _, _ in plot.legend_entries()]
    assert {p["drafter"] for p in RESULT["measured"] if p["draft_len"]} == {"draft", "self", "substitute"}
    assert "chosen" in labels and "predicted (dashed)" in labels
    assert ("plain decoding" in labels) == any(p["draft_len"] == 0 for p in RESULT["measured"])
    for drafter, name in (("draft", "draft model"), ("self", "self"), ("substitute", "substitutes")):
        default = [
            p for p in RESULT["measured"] if p["drafter"] == drafter and not (p["prefetch"] or p["policy"])
        ]
        assert {f"{name}, {p['draft_len']} tokens" for p in default} <= set(labels)
    colours = {plot.series_color(key).name() for key in (("draft", 2), ("self", 2), ("substitute", 2))}
    assert len(colours) == 3
    # the leader under another prefetch or cache policy is the summary's, not a curve's
    variants = [p for p in RESULT["measured"] if p["prefetch"] or p["policy"]]
    assert variants and sum(len(bars) for bars in plot._measured.values()) == len(RESULT["measured"]) - len(
        variants
    )
    # each drafter's prediction, drawn with it
    assert {drafter for drafter, length in plot._predicted if length} == {"draft", "self", "substitute"}
    plot.resize(760, 340)
    assert plot.grab().width() == 760


def test_the_choice_names_its_drafter_prefetch_and_cache_policy():
    choice = {"cutoff_layer": -1, "draft_len": 3, "cache_experts": 8, "drafter": "substitute"}
    assert "draft length 3 with substitute experts" in describe_choice(choice)
    assert "next-layer prefetch" in describe_choice({**choice, "prefetch": "next-layer", "policy": "mrs"})
    assert "(MRS)" in describe_choice({**choice, "policy": "mrs"})
