"""App settings: validation naming the field, engine configs, reload rules, the JSON store, the dialog."""

import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from PySide6.QtWidgets import QDialogButtonBox

from app.gui.settings.settings_dialog import SIM_LINK_WITH_GPU, SettingsDialog
from app.settings import AppSettings, SettingsError, SettingsStore
from app.settings.app_settings import needs_reload
from app.settings.fields import FIELDS
from app.settings.store import config_dir
from engine.config import ExpertBudget
from engine.generation_config import SPEC_CHOICES, SamplingConfig
from tests.screenshots import save_screenshot

# ---- the model ------------------------------------------------------------------------------------


def test_defaults_are_valid_and_match_the_engine():
    settings = AppSettings()
    settings.validate()
    offload = settings.to_offload_config()
    assert offload.device == "auto" and offload.expert_budget.is_auto and offload.expert_dtype == "native"
    # the product's point is on by default: the engine resolves `auto` for the model loaded
    assert settings.to_spec_config().mode == "auto" and settings.prefetch == "auto"
    assert settings.generation_config(SamplingConfig(), 8).prefetch == "auto"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device", "tpu"),
        ("expert_budget", "lots"),
        ("expert_budget", "0"),
        ("spec_mode", "off"),
        ("draft_len", 0),
        ("draft_len", 17),
        ("draft_len", "4"),
        ("prefetch", "always"),
        ("cpu_experts", "sometimes"),
        ("expert_dtype", "fp8"),
        ("policy", "fifo"),
        ("sim_link_gbps", 0.0),
        ("sim_link_gbps", -3.0),
        ("sim_link_gbps", float("nan")),
        ("sim_link_gbps", "fast"),
        ("model_path", ""),
        ("model_path", 42),
        ("device", None),
    ],
)
def test_each_bad_field_is_named(field, value):
    with pytest.raises(SettingsError) as info:
        replace(AppSettings(), **{field: value}).validate()
    assert info.value.field == field
    assert str(info.value).startswith(FIELDS[field].title + ":")


def test_cross_field_rules_name_the_field_to_change(tmp_path):
    with pytest.raises(SettingsError) as info:
        AppSettings(model_path=str(tmp_path), spec_mode="draft").validate()
    assert info.value.field == "draft_model"
    with pytest.raises(SettingsError) as info:
        AppSettings(prefetch="spmoe", spec_mode="none").validate()
    assert info.value.field == "prefetch"
    AppSettings(prefetch="spmoe", spec_mode="self").validate()
    AppSettings(prefetch="spmoe").validate()  # the default speculation (auto) drafts


def test_folders_are_checked_only_when_asked(tmp_path):
    missing = AppSettings(model_path=str(tmp_path / "nope"))
    missing.validate()  # a stored path on an unplugged drive is kept
    with pytest.raises(SettingsError) as info:
        missing.validate(check_folders=True)
    assert info.value.field == "model_path"
    AppSettings(model_path=str(tmp_path)).validate(check_folders=True)


def test_engine_configs_carry_the_settings(tmp_path):
    settings = AppSettings(
        model_path=str(tmp_path),
        device="cpu",
        expert_budget="2GiB",
        spec_mode="draft",
        draft_model=str(tmp_path / "draft"),
        draft_len=6,
        prefetch="spmoe",
        cpu_experts="auto",
        expert_dtype="int4",
        policy="mrs",
        sim_link_gbps=16.0,
    )
    settings.validate()
    offload = settings.to_offload_config()
    assert offload.expert_budget == ExpertBudget(nbytes=2 * 1024**3)
    assert (offload.device, offload.policy, offload.expert_dtype, offload.sim_link_gbps) == (
        "cpu",
        "mrs",
        "int4",
        16.0,
    )
    sampling = SamplingConfig(temperature=0.2, seed=7)
    config = settings.generation_config(sampling, max_new_tokens=99)
    config.validate()
    assert config.max_new_tokens == 99 and config.sampling == sampling
    assert (config.spec.mode, config.spec.draft_model, config.spec.draft_len) == (
        "draft",
        str(tmp_path / "draft"),
        6,
    )
    assert (config.prefetch, config.cpu_experts) == ("spmoe", "auto")


def test_a_draft_model_given_under_auto_is_the_one_auto_drafts_with(tmp_path):
    from engine.speculative.auto import resolve

    spec = AppSettings(spec_mode="auto", draft_model=str(tmp_path / "draft")).to_spec_config()
    model = SimpleNamespace(path=str(tmp_path / "model"), top_k=8)  # no bundled draft of its own
    chosen = resolve(model, spec, "auto", None)
    assert (chosen.spec.mode, chosen.spec.draft_model) == ("draft", spec.draft_model)
    assert chosen.prefetch == "spmoe"


def test_draft_mode_on_the_demo_model_drafts_with_the_demo_draft():
    spec = AppSettings(spec_mode="draft").to_spec_config()
    assert spec.draft_model is not None and Path(spec.draft_model).name == "draft"


def test_needs_reload_only_for_model_and_offload_fields():
    base = AppSettings()
    for field, value in [
        ("model_path", "/m"),
        ("device", "cpu"),
        ("expert_budget", "64"),
        ("expert_dtype", "int8"),
        ("policy", "lfu"),
        ("sim_link_gbps", 8.0),
    ]:
        assert needs_reload(base, replace(base, **{field: value})), field
    for field, value in [
        ("spec_mode", "self"),
        ("draft_model", "/d"),
        ("draft_len", 8),
        ("prefetch", "hybrimoe"),
        ("cpu_experts", "always"),
    ]:
        assert not needs_reload(base, replace(base, **{field: value})), field
    assert not needs_reload(replace(base, expert_budget="2GiB"), replace(base, expert_budget="2 gib"))
    assert AppSettings.needs_reload(base, replace(base, policy="mrs"))  # also reachable from the class
    assert not AppSettings.needs_reload(base, replace(base, draft_len=2))


def test_fields_describe_every_setting_with_its_choices():
    assert list(FIELDS) == [f for f in FIELDS if hasattr(AppSettings(), f)]
    assert set(FIELDS) == set(AppSettings.__dataclass_fields__)
    assert [v for v, _ in FIELDS["spec_mode"].choices] == list(SPEC_CHOICES)
    assert all(info.title and info.summary and info.help for info in FIELDS.values())


# ---- the store ------------------------------------------------------------------------------------


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config"


def test_round_trip_through_the_store(config_home):
    store = SettingsStore()
    assert store.path == config_home / "settings.json" and config_dir() == config_home
    assert store.load() == AppSettings() and store.problems == []  # no file yet: defaults, quietly
    settings = AppSettings(expert_budget="48", spec_mode="self", prefetch="spmoe", sim_link_gbps=12.5)
    store.save(settings)
    assert SettingsStore().load() == settings
    assert json.loads(store.path.read_text())["version"] == 1
    assert [p.name for p in config_home.iterdir()] == ["settings.json"]  # no temporary file left


def test_save_refuses_invalid_settings_and_keeps_the_old_file(config_home):
    store = SettingsStore()
    store.save(AppSettings(draft_len=5))
    with pytest.raises(SettingsError):
        store.save(AppSettings(draft_len=99))
    assert store.load().draft_len == 5


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "", "\x00\xff"])
def test_a_corrupt_file_gives_the_defaults_with_a_warning(config_home, caplog, text):
    config_home.mkdir()
    (config_home / "settings.json").write_text(text, encoding="latin-1")
    store = SettingsStore()
    with caplog.at_level(logging.WARNING, logger="app.settings"):
        assert store.load() == AppSettings()
    assert len(store.problems) == 1 and "Using the default settings" in caplog.text


def test_a_partial_file_keeps_what_is_valid(config_home, caplog, tmp_path):
    config_home.mkdir()
    stored = {
        "version": 1,
        "device": "cpu",
        "draft_len": 40,
        "policy": "mrs",
        "colour": "blue",
        "spec_mode": "none",
        "prefetch": "spmoe",
    }
    (config_home / "settings.json").write_text(json.dumps(stored))
    store = SettingsStore()
    with caplog.at_level(logging.WARNING, logger="app.settings"):
        settings = store.load()
    # draft_len and prefetch reset; speculation stays off as stored (the default would be auto)
    assert settings == AppSettings(device="cpu", policy="mrs", spec_mode="none")
    assert len(store.problems) == 3
    assert "'colour'" in caplog.text and "Draft length" in caplog.text and "Expert prefetch" in caplog.text


# ---- the dialog -----------------------------------------------------------------------------------


def _button(dialog: SettingsDialog, which):
    return dialog.button_box.button(which)


@pytest.mark.gui
def test_ok_emits_the_new_settings(qtbot):
    dialog = SettingsDialog(AppSettings())
    qtbot.addWidget(dialog)
    editors = dialog._editors
    editors["device"].set_value("cpu")
    editors["expert_budget"].line.setText("1.5GiB")
    editors["spec_mode"].set_value("self")
    editors["draft_len"].spin.setValue(7)
    editors["prefetch"].set_value("spmoe")
    editors["sim_link_gbps"].spin.setValue(16.0)
    assert dialog.reload_note.text()  # device and budget changed: the model will be loaded again
    with qtbot.waitSignal(dialog.sig_applied) as applied:
        _button(dialog, QDialogButtonBox.StandardButton.Ok).click()
    expected = AppSettings(
        device="cpu",
        expert_budget="1.5GiB",
        spec_mode="self",
        draft_len=7,
        prefetch="spmoe",
        sim_link_gbps=16.0,
    )
    assert applied.args == [expected] and dialog.settings() == expected
    assert dialog.result() == SettingsDialog.DialogCode.Accepted


@pytest.mark.gui
def test_invalid_input_is_shown_inline_and_the_dialog_stays_open(qtbot, tmp_path):
    dialog = SettingsDialog(AppSettings())
    qtbot.addWidget(dialog)
    dialog.show()
    received = []
    dialog.sig_applied.connect(received.append)
    dialog._editors["expert_budget"].line.setText("plenty")
    _button(dialog, QDialogButtonBox.StandardButton.Ok).click()
    assert dialog.isVisible() and received == []
    assert dialog.error_text().startswith("Expert cache budget:")
    assert "Cannot read expert budget" in dialog._help["expert_budget"].text()
    dialog._editors["expert_budget"].line.setText("")  # empty means auto
    dialog._editors["model_path"].line.setText(str(tmp_path / "missing"))
    _button(dialog, QDialogButtonBox.StandardButton.Apply).click()
    assert dialog.error_text().startswith("Model folder:") and received == []
    assert dialog._help["expert_budget"].text() == FIELDS["expert_budget"].summary
    dialog._editors["model_path"].line.setText(str(tmp_path))
    _button(dialog, QDialogButtonBox.StandardButton.Apply).click()
    assert received == [AppSettings(model_path=str(tmp_path))] and dialog.error_text() == ""
    assert dialog.isVisible() and dialog.reload_note.text() == ""  # applied: nothing pending


@pytest.mark.gui
def test_dependent_fields_and_the_gpu_case(qtbot):
    # speculation off (it is on by default), so the draft fields start disabled
    dialog = SettingsDialog(AppSettings(sim_link_gbps=8.0, spec_mode="none"), gpu_available=True)
    qtbot.addWidget(dialog)
    editors = dialog._editors
    assert not editors["sim_link_gbps"].widget.isEnabled()
    assert dialog._help["sim_link_gbps"].text() == SIM_LINK_WITH_GPU
    assert not editors["draft_model"].widget.isEnabled() and not editors["draft_len"].widget.isEnabled()
    editors["spec_mode"].set_value("draft")
    assert editors["draft_model"].widget.isEnabled() and editors["draft_len"].widget.isEnabled()
    editors["spec_mode"].set_value("auto")  # a draft model given under auto is the one it drafts with
    assert editors["draft_model"].widget.isEnabled() and editors["draft_len"].widget.isEnabled()
    editors["spec_mode"].set_value("self")  # self-drafting has no draft model
    assert not editors["draft_model"].widget.isEnabled() and editors["draft_len"].widget.isEnabled()
    assert dialog.settings().sim_link_gbps == 8.0  # kept, only not editable
    assert not dialog.tune_button.isEnabled() and "not available" in dialog.tune_button.toolTip()
    dialog.set_tune_available(True)
    with qtbot.waitSignal(dialog.sig_tune_requested):
        dialog.tune_button.click()
    _button(dialog, QDialogButtonBox.StandardButton.RestoreDefaults).click()
    assert dialog.settings() == AppSettings()


@pytest.mark.gui
def test_screenshot_of_the_dialog(qtbot, tmp_path):
    settings = AppSettings(expert_budget="plenty", spec_mode="self", prefetch="spmoe", sim_link_gbps=16.0)
    dialog = SettingsDialog(settings)
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    dialog.apply()  # shows the inline error for the budget
    qtbot.wait(50)
    save_screenshot(dialog, "settings.png", tmp_path)


def test_the_settings_offer_only_kernels_that_run_here(monkeypatch):
    from app.settings import fields
    from engine.ggml import library

    monkeypatch.setattr(library, "installed", lambda: (False, "no AVX2"))
    assert fields._offered_kernels() == ("auto", "exact")
    monkeypatch.setattr(library, "installed", lambda: (True, ""))
    assert fields._offered_kernels() == ("auto", "exact", "ggml")


def test_the_context_length_kv_precision_and_kernels_reach_the_engine():
    offload = AppSettings(context_length=4096, kv_dtype="bfloat16", kernels="ggml").to_offload_config()
    assert offload.context_length == 4096 and offload.kv_dtype == "bfloat16" and offload.kernels == "ggml"
    assert AppSettings().to_offload_config().kernels == "auto"  # ggml where it runs, resolved at load
    with pytest.raises(SettingsError, match="CPU kernels"):
        AppSettings(kernels="fast").validate()
    assert AppSettings().to_offload_config().context_length is None  # the model's own window
    with pytest.raises(SettingsError, match="Context length: must be between 16 and"):
        AppSettings(context_length=8).validate()
