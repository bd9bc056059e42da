"""A dashboard that reads: the last reply's figures stay greyed between replies, fields that do not
apply say why, and every engine state reads the same on the dashboard and in the status bar.

The window's client is never started: the tests play the engine's part with its signals
(`Loaded`, `Stats`, a reply's `Finished`, a dead worker), so the window's own handlers run.
Each state's screenshot is the dashboard dock of a 1280×800 window.
"""

from dataclasses import replace

import pytest

from app.gui.dashboard.dashboard import NA, Dashboard, reply_figures
from app.gui.engine.engine_state import IN_PLACE_NOTE, SIMULATED_LINK, SIMULATED_LINK_NOTE, EngineState
from app.gui.window.main_window import MainWindow
from app.settings import AppSettings
from engine.worker.protocol import PROTOCOL_VERSION, DeviceInfo, Finished, Ready
from tests.app.gui.dashboard.test_dashboard import MODEL, make_stats
from tests.app.gui.window.test_screens import as_screen, open_window
from tests.screenshots import save_screenshot

pytestmark = pytest.mark.gui

REPLY = {  # a `GenerationStats` dict as the `Finished` event carries it (the fields read here)
    "generated_tokens": 96,
    "tokens_per_s": 12.4,
    "tpot_ms": 80.6,
    "h2d_gbps": 3.2,
    "h2d_bytes": 512 * 1024**2,
    "hit_rate": 0.91,
    "hits": 4100,
    "misses": 400,
    "accept_len": 2.75,
    "prefetch_precision": 0.82,
    "prefetch_recall": 0.7,
    "spec": "draft",
    "prefetch": "spmoe",
    "simulated_link": True,
}
SPEC_ON = AppSettings(device="cpu", spec_mode="draft", prefetch="spmoe")
IDLE = make_stats(generating=False, h2d_gbps=0.0, hit_rate=None, tokens_per_s=None, cutoff_layer=None)


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


def shot(qtbot, window, name: str, tmp_path) -> None:
    qtbot.wait(250)  # a shown or hidden note re-lays the dock out over a few event-loop turns
    save_screenshot(window.dashboard_dock, name, tmp_path)


def figures(dash: Dashboard, key: str) -> tuple[str, str]:
    tile = dash.tiles[key]
    return tile.value.text(), tile.detail.text()


def test_the_last_reply_stays_greyed_between_replies_instead_of_blanking(qtbot):
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.set_model(MODEL)
    dash.set_decoding("draft", "spmoe")
    dash.update_stats(make_stats())
    assert not dash.tiles["tokens_per_s"].value.is_muted()
    dash.reply_ended(REPLY)
    dash.update_stats(IDLE)  # the engine's idle sample: 0.00 GB/s, no rates
    assert figures(dash, "tokens_per_s") == ("12.4 tok/s", "last reply · 96 tokens")
    assert figures(dash, "link") == (
        "3.20 GB/s",
        "last reply · counted on the simulated link · 512.0 MiB copied",
    )
    assert figures(dash, "hit_rate")[0] == "91.0 %"
    assert figures(dash, "accept_len")[0] == "2.75 tokens"
    assert figures(dash, "cutoff") == ("17", "last reply · last MoE layer prefetched of 0–47")
    for key in ("link", "hit_rate", "tokens_per_s", "tpot", "accept_len", "prefetch", "cutoff"):
        assert dash.tiles[key].value.is_muted(), key
        assert dash.tiles[key].detail.text().startswith("last reply"), key
    assert not dash.tiles["host_ram"].value.is_muted()  # memory stays live
    dash.update_stats(make_stats(time_s=200.0, tokens_per_s=9.0))  # the next reply: live again
    assert figures(dash, "tokens_per_s") == ("9.0 tok/s", "generating · 120 tokens")
    assert not dash.tiles["tokens_per_s"].value.is_muted()


def test_on_a_cpu_with_no_link_simulated_the_link_tile_says_nothing_is_copied(qtbot):
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.set_model({**MODEL, "device": "cpu", "simulated_link": False, "experts_in_place": True})
    assert figures(dash, "link") == ("none", IN_PLACE_NOTE)  # before any reply, not "n/a"
    dash.update_stats(make_stats(simulated_link=False, h2d_gbps=0.0))
    dash.reply_ended({**REPLY, "simulated_link": False, "h2d_gbps": 0.0, "h2d_bytes": 0})
    assert figures(dash, "link") == ("none", IN_PLACE_NOTE)  # never "0.00 GB/s"
    assert not dash.simulated_label.isVisibleTo(dash)


def test_fields_that_do_not_apply_say_why_instead_of_zero_or_minus_one():
    off = reply_figures({**REPLY, "spec": "none", "prefetch": "none", "prefetch_recall": 0.0}, live=True)
    assert off["accept_len"] == ("off", "speculation off")
    assert off["prefetch"] == ("off", "prefetch off")
    assert off["cutoff"] == ("no cutoff", "prefetch off")
    no_layer = reply_figures({**REPLY, "cutoff_layer": -1}, live=True)
    assert no_layer["cutoff"] == ("no cutoff", "nothing prefetched from the draft")
    other = reply_figures({**REPLY, "prefetch": "hybrimoe", "cutoff_layer": None}, live=False)
    assert other["cutoff"] == ("no cutoff", "spmoe prefetch only (hybrimoe now)")
    unknown = reply_figures({"accept_len": None}, live=True)  # no mode known: the figure as it is
    assert unknown["accept_len"][0] == NA


def test_a_live_reply_under_auto_names_what_the_engine_resolved(qtbot):
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.set_model(MODEL)
    dash.set_decoding("auto", "auto")  # the settings do not say: the engine's Stats do
    dash.update_stats(make_stats(extra={"spec": "draft", "prefetch": "spmoe"}))
    assert figures(dash, "accept_len") == ("3.25 tokens", "draft model · per verify step, bonus included")
    assert figures(dash, "prefetch") == ("80.0 % / 65.0 %", "SP-MoE · precision / recall")
    assert figures(dash, "cutoff") == ("17", "last MoE layer prefetched of 0–47")
    # the reply's own stats describe the policy at length; its name is what the tiles read
    dash.reply_ended({**REPLY, "prefetch": "spmoe (cutoff 17 of 48 MoE layers, auto)"})
    assert figures(dash, "cutoff") == ("17", "last reply · last MoE layer prefetched of 0–47")
    assert figures(dash, "prefetch")[1] == "last reply · SP-MoE · precision / recall"

    dash.update_stats(make_stats(time_s=200.0, extra={"spec": "none", "prefetch": "none"}))
    assert figures(dash, "accept_len") == ("off", "speculation off")
    assert figures(dash, "prefetch") == ("off", "prefetch off")


def test_a_crash_mid_reply_never_stays_generating(qtbot):
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.set_model(MODEL)
    dash.update_stats(make_stats(generated_tokens=0, tokens_per_s=0.0))
    dash.set_state(EngineState.CRASHED, "The engine stopped")
    assert figures(dash, "tokens_per_s") == ("0.0 tok/s", "last reply · 0 tokens")
    assert dash.tiles["vram"].value.is_muted() and dash.tiles["host_ram"].value.is_muted()


def _states_window(qtbot, monkeypatch, settings: AppSettings):
    as_screen(monkeypatch, 1280, 800)
    window = open_window(qtbot)
    window.settings = settings
    window.dashboard.set_decoding(settings.spec_mode, settings.prefetch)
    monkeypatch.setattr(window.client, "restart", lambda: None)  # no worker: the test plays it
    monkeypatch.setattr(window.client, "load_model", lambda *args: "load-2")
    return window


def _consistent(window) -> str:
    line = window.engine_label.text()
    assert window.dashboard.status.text() == line, "the dashboard and the status bar disagree"
    return line


def _reply(qtbot, window, stats: dict | None = None) -> None:
    """A reply streams (two `Stats`) and, with `stats`, finishes."""
    window.session.send("Tell me about experts.")
    window.client.sig_stats.emit(make_stats(time_s=10.0, simulated_link=True))
    window.client.sig_stats.emit(make_stats(time_s=10.25, simulated_link=True, tokens_per_s=12.0))
    if stats is not None:
        rid = window.session.reply.request_id
        window.client.sig_reply.emit(Finished(rid, "eos", "Experts are …", "", 12, 96, stats))
        window.client.sig_stats.emit(replace(IDLE, time_s=11.0))


def test_every_state_reads_the_same_on_the_dashboard_and_the_status_bar(qtbot, dirs, monkeypatch, tmp_path):
    window = _states_window(qtbot, monkeypatch, SPEC_ON)
    dash = window.dashboard
    assert window.state is EngineState.IDLE and "ready" in _consistent(window)
    assert dash.is_simulated_shown() and dash.simulated_label.text() == SIMULATED_LINK_NOTE
    assert SIMULATED_LINK in _consistent(window)
    _reply(qtbot, window, REPLY)
    assert window.state is EngineState.IDLE
    assert figures(dash, "tokens_per_s") == ("12.4 tok/s", "last reply · 96 tokens")
    shot(qtbot, window, "dashboard-idle-last-reply.png", tmp_path)

    _reply(qtbot, window)
    assert window.state is EngineState.GENERATING and "generating" in _consistent(window)
    shot(qtbot, window, "dashboard-generating.png", tmp_path)

    restarts = []  # held back until the crashed state is on screen
    monkeypatch.setattr(window, "_restart_after_crash", lambda: restarts.append(True))
    window.client.sig_worker_died.emit("The engine stopped unexpectedly (exit code -9).")
    assert window.state is EngineState.CRASHED and _consistent(window) == "The engine stopped"
    assert dash.title.text() == "The engine stopped"
    assert "generating" not in figures(dash, "tokens_per_s")[1]
    shot(qtbot, window, "dashboard-crashed.png", tmp_path)

    assert restarts == [True]  # scheduled at once, after one event-loop turn
    MainWindow._restart_after_crash(window)
    assert window.state is EngineState.RESTARTING
    assert _consistent(window) == "Restarting the engine…" and dash.title.text() == "Restarting the engine…"
    shot(qtbot, window, "dashboard-restarting.png", tmp_path)

    window.client.sig_ready.emit(Ready("", PROTOCOL_VERSION, 1, DeviceInfo("cpu", "CPU", None, "2.13")))
    window.client.sig_load_progress.emit("load-2", "experts", 3, 8)
    assert window.state is EngineState.LOADING
    assert _consistent(window) == "Loading MoE Chat Demo… · experts 3/8"
    assert dash.title.text() == "Loading a model…"  # never "No model loaded", never the old model
    shot(qtbot, window, "dashboard-loading.png", tmp_path)

    window.client.sig_error.emit("load-2", "model_not_found", "No model in /nowhere.")
    assert window.state is EngineState.NO_MODEL and dash.title.text() == "No model loaded"
    assert _consistent(window) == "No model loaded: the last load failed"


def test_prefetch_and_speculation_off_say_so(qtbot, dirs, monkeypatch, tmp_path):
    window = _states_window(qtbot, monkeypatch, AppSettings(device="cpu", spec_mode="none", prefetch="none"))
    _reply(qtbot, window, {**REPLY, "spec": "none", "prefetch": "none", "accept_len": None})
    dash = window.dashboard
    assert figures(dash, "accept_len") == ("off", "speculation off")
    assert figures(dash, "prefetch") == ("off", "prefetch off")
    assert figures(dash, "cutoff") == ("no cutoff", "prefetch off")
    shot(qtbot, window, "dashboard-prefetch-off.png", tmp_path)


def test_the_simulated_link_is_named_alike_everywhere(qtbot, dirs, monkeypatch, tmp_path):
    window = _states_window(qtbot, monkeypatch, SPEC_ON)
    _reply(qtbot, window, REPLY)
    dash = window.dashboard
    assert SIMULATED_LINK_NOTE.lower().startswith(SIMULATED_LINK)
    assert SIMULATED_LINK in window.engine_label.text()
    assert SIMULATED_LINK in window.chat_view._bubbles[-1].stats.text()
    assert dash.tiles["link"].title.text() == "Host → device (simulated)"
    assert "SIMULATED LINK" not in dash.simulated_label.text()  # one wording, not a second, louder one
    shot(qtbot, window, "dashboard-simulated-link.png", tmp_path)
