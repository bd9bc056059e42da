"""The live dashboard and its sparklines: pure helpers, figures from Stats, no re-layout, screenshot."""

import random
from dataclasses import replace

import pytest
from PySide6.QtCore import QEvent, QObject

from app.gui.dashboard.dashboard import (
    NA,
    SIMULATED_TEXT,
    Dashboard,
    fmt_gbps,
    fmt_used_total,
    model_summary,
    reply_figures,
)
from app.gui.dashboard.sparkline import Sparkline, to_pixels, trim_window, y_scale
from app.gui.engine.engine_state import EngineState, state_line
from engine.worker.protocol import Stats
from tests.screenshots import screenshot_path

GIB = 1024**3

MODEL = {
    "path": "/models/Qwen3-30B-A3B",
    "model_type": "qwen3_moe",
    "num_layers": 48,
    "moe_layers": 48,
    "num_experts": 128,
    "top_k": 8,
    "cache_slots": 512,
    "device": "cpu",
    "simulated_link": True,
    "expert_dtype": "int4",
}


def make_stats(**changes) -> Stats:
    base = Stats(
        request_id="",
        time_s=100.0,
        generating=True,
        simulated_link=True,
        vram_used_bytes=None,
        vram_total_bytes=None,
        torch_allocated_bytes=None,
        torch_reserved_bytes=None,
        host_ram_used_bytes=int(21.5 * GIB),
        host_ram_total_bytes=64 * GIB,
        process_rss_bytes=int(17.25 * GIB),
        h2d_bytes=3 * GIB,
        h2d_gbps=6.4,
        pcie_rx_gbps=None,
        pcie_tx_gbps=None,
        hits=9000,
        misses=1000,
        hit_rate=0.875,
        hit_rate_total=0.9,
        hit_rate_by_phase={"draft": 0.95, "verify": 0.85},
        generated_tokens=120,
        tokens_per_s=11.5,
        tpot_ms=86.96,
        accept_len=3.25,
        prefetch_precision=0.8,
        prefetch_recall=0.65,
        cutoff_layer=17,
        cache_slots_used=384,
        cache_slots_total=512,
    )
    return replace(base, **changes)


IDLE_NO_MODEL = make_stats(
    generating=False,
    simulated_link=None,
    h2d_bytes=0,
    h2d_gbps=None,
    hits=0,
    misses=0,
    hit_rate=None,
    hit_rate_total=None,
    generated_tokens=0,
    tokens_per_s=None,
    tpot_ms=None,
    accept_len=None,
    prefetch_precision=None,
    prefetch_recall=None,
    cutoff_layer=None,
    cache_slots_used=None,
    cache_slots_total=None,
)


# ---- sparkline helpers (no painting) --------------------------------------------------------------


def test_trim_window_keeps_the_last_window_only():
    samples = [(0.0, 1.0), (30.0, 2.0), (59.0, None), (90.0, 3.0)]
    assert trim_window(samples, now=90.0, window_s=60.0) == [(30.0, 2.0), (59.0, None), (90.0, 3.0)]
    assert trim_window(samples, now=200.0, window_s=60.0) == []


def test_y_scale_is_fixed_or_the_largest_value_with_headroom():
    assert y_scale([0.2, 0.5], fixed_max=1.0) == 1.0
    assert y_scale([2.0, None, 10.0]) == pytest.approx(11.0)
    assert y_scale([]) == 1.0 and y_scale([0.0, None]) == 1.0  # a flat line sits on the baseline


def test_to_pixels_maps_time_and_value_and_splits_at_gaps():
    samples = [(40.0, 0.0), (70.0, 0.5), (80.0, None), (90.0, 1.0), (100.0, 2.0)]
    segments = to_pixels(samples, now=100.0, y_max=1.0, width=110, height=60, window_s=60.0, margin=5)
    assert len(segments) == 2  # the None at t=80 breaks the line
    (x0, y0), (x1, y1) = segments[0]
    assert (x0, y0) == (5.0, 55.0)  # oldest edge, value 0 → bottom
    assert x1 == pytest.approx(5 + 100 * 0.5) and y1 == pytest.approx(30.0)
    (x2, y2), (x3, y3) = segments[1]
    assert x2 == pytest.approx(5 + 100 * 50 / 60) and y2 == pytest.approx(5.0)  # value == y_max → top
    assert (x3, y3) == (105.0, 5.0)  # newest at the right edge; above y_max clamped to the top


def test_sparkline_keeps_a_minute_and_restarts_on_an_older_clock(qtbot):
    line = Sparkline(window_s=60.0)
    qtbot.addWidget(line)
    for t in range(0, 120, 10):
        line.add(float(t), float(t))
    assert [t for t, _ in line.samples()] == [50.0, 60.0, 70.0, 80.0, 90.0, 100.0, 110.0]
    line.add(5.0, None)  # a new worker: its clock starts again
    assert line.samples() == [(5.0, None)]


# ---- dashboard --------------------------------------------------------------------------------------


def _text(dashboard: Dashboard, key: str) -> tuple[str, str]:
    tile = dashboard.tiles[key]
    return tile.value.text(), tile.detail.text()


@pytest.mark.gui
def test_without_a_model_it_says_so_and_never_invents_a_figure(qtbot):
    dash = Dashboard()
    qtbot.addWidget(dash)
    assert dash.title.text() == "Starting the engine…"
    dash.set_state(EngineState.NO_MODEL, state_line(EngineState.NO_MODEL))
    assert dash.title.text() == "No model loaded"
    assert dash.status.text() == "No model loaded: the last load failed"
    assert all(tile.value.text() == NA for tile in dash.tiles.values())
    assert dash.cache_bar.text() == NA and not dash.is_simulated_shown()
    dash.update_stats(IDLE_NO_MODEL)
    assert _text(dash, "host_ram") == ("21.5 / 64.0 GiB", "engine process 17.2 GiB")
    assert _text(dash, "link") == (NA, "no model loaded")
    assert _text(dash, "tokens_per_s") == (NA, "no model loaded")
    assert not dash.is_simulated_shown()


@pytest.mark.gui
def test_a_stream_of_stats_shows_the_right_figures(qtbot):
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.set_model(MODEL)
    assert dash.title.text() == "Qwen3-30B-A3B"
    assert "48 MoE layers × 128 experts (top-8)" in dash.summary.text()
    for i in range(5):
        dash.update_stats(make_stats(time_s=100.0 + i / 4, tokens_per_s=10.0 + i))
    assert _text(dash, "vram") == (NA, "torch allocator n/a")  # no GPU: never a made-up number
    assert _text(dash, "link") == ("6.40 GB/s", "counted on the simulated link · 3.0 GiB copied")
    assert dash.tiles["link"].title.text() == "Host → device (simulated)"
    assert _text(dash, "hit_rate") == ("87.5 %", "cumulative 90.0 % · 9,000 hits / 1,000 misses")
    assert _text(dash, "tokens_per_s") == ("14.0 tok/s", "generating · 120 tokens")
    assert _text(dash, "tpot")[0] == "87.0 ms"
    assert _text(dash, "accept_len")[0] == "3.25 tokens"
    assert _text(dash, "prefetch") == ("80.0 % / 65.0 %", "precision / recall")
    assert _text(dash, "cutoff") == ("17", "last MoE layer prefetched of 0–47")
    assert dash.cache_bar.text() == "384 / 512 slots · 75 %"
    assert dash.is_simulated_shown() and dash.simulated_label.text() == SIMULATED_TEXT
    assert [v for _, v in dash.tiles["tokens_per_s"].sparkline.samples()] == [10.0, 11.0, 12.0, 13.0, 14.0]


@pytest.mark.gui
def test_a_gpu_shows_nvml_and_torch_figures_and_no_simulated_label(qtbot):
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.set_model({**MODEL, "device": "cuda:0", "simulated_link": True})
    assert dash.is_simulated_shown()
    gpu = make_stats(
        simulated_link=False,
        vram_used_bytes=int(20.5 * GIB),
        vram_total_bytes=24 * GIB,
        torch_allocated_bytes=18 * GIB,
        torch_reserved_bytes=19 * GIB,
        h2d_gbps=24.6,
        pcie_rx_gbps=25.125,
        accept_len=None,
    )
    dash.update_stats(gpu)
    assert not dash.is_simulated_shown()
    assert _text(dash, "vram") == ("20.5 / 24.0 GiB", "torch allocator 18.0 GiB (reserved 19.0 GiB)")
    assert _text(dash, "link") == ("24.6 GB/s", "NVML PCIe rx 25.1 GB/s · 3.0 GiB copied")
    assert dash.tiles["link"].title.text() == "Host → device"
    assert _text(dash, "accept_len")[0] == NA
    assert dash.tiles["vram"].sparkline.fixed_max == pytest.approx(24.0)
    dash.update_stats(replace(gpu, simulated_link=True))
    assert dash.is_simulated_shown()
    dash.set_model(None)
    assert not dash.is_simulated_shown() and dash.tiles["vram"].sparkline.samples() == []


def test_formatting_never_invents_a_figure():
    assert fmt_used_total(None, 24 * GIB) == NA
    assert fmt_used_total(3 * GIB, None) == "3.0 GiB"
    assert fmt_gbps(None) == NA and fmt_gbps(0.5) == "0.50 GB/s"
    assert model_summary({}) == "" and model_summary({"model_type": "mixtral"}) == "mixtral"
    kernels = {"model_type": "qwen3_moe", "expert_dtype": "Q4_K", "kernels": "ggml"}
    assert model_summary(kernels) == "qwen3_moe · experts Q4_K · ggml kernels"
    assert model_summary(kernels | {"kernels": "exact"}) == "qwen3_moe · experts Q4_K"


class _LayoutRequests(QObject):
    def __init__(self):
        super().__init__()
        self.count = 0

    def eventFilter(self, watched, event):
        if event.type() == QEvent.Type.LayoutRequest:
            self.count += 1
        return False


@pytest.mark.gui
def test_updates_at_4_hz_do_not_re_layout(qtbot):
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.set_model(MODEL)
    dash.resize(900, 520)
    dash.show()
    qtbot.waitExposed(dash)
    dash.update_stats(make_stats())
    qtbot.wait(50)
    watcher = _LayoutRequests()
    for widget in [dash, *dash.findChildren(QObject)]:
        widget.installEventFilter(watcher)
    for i in range(20):
        dash.update_stats(make_stats(time_s=101.0 + i / 4, h2d_gbps=5.0 + i, tokens_per_s=9.0 + i % 3))
        qtbot.wait(5)
    qtbot.wait(300)
    assert watcher.count == 0
    assert _text(dash, "link")[0] == "24.0 GB/s"


@pytest.mark.gui
def test_screenshot_of_a_simulated_run(qtbot, tmp_path):
    dash = Dashboard()
    qtbot.addWidget(dash)
    dash.set_model(MODEL)
    dash.resize(900, 500)
    dash.show()
    qtbot.waitExposed(dash)
    rng = random.Random(0)
    speed = 10.0
    for i in range(240):  # a minute at 4 Hz: decoding, a pause between replies, decoding again
        busy = not 80 <= i < 110
        speed = min(max(speed + rng.uniform(-0.6, 0.6), 7.0), 13.0)
        dash.update_stats(
            make_stats(
                time_s=40.0 + i / 4,
                generating=busy,
                h2d_gbps=(speed * 0.42 + rng.uniform(-0.3, 0.3)) if busy else 0.0,
                hit_rate=min(0.6 + i / 500 + rng.uniform(-0.04, 0.04), 0.97) if busy else None,
                hit_rate_total=min(0.55 + i / 600, 0.9),
                tokens_per_s=speed if busy else None,
                tpot_ms=1000 / speed if busy else None,
                accept_len=2.9 + rng.uniform(-0.3, 0.3),
                prefetch_recall=0.62 + rng.uniform(-0.06, 0.06),
                generated_tokens=i * 3,
                cache_slots_used=min(200 + i, 512),
                host_ram_used_bytes=int((21.0 + i / 200) * GIB),
            )
        )
    qtbot.wait(400)  # the sparklines' coalesced repaint
    path = screenshot_path("dashboard.png", tmp_path)
    assert dash.grab().save(str(path))
    assert path.stat().st_size > 0


def test_the_last_reply_says_how_much_of_its_prompt_a_kept_cache_held():
    reply = {"generated_tokens": 9, "prompt_tokens": 120, "cached_prompt_tokens": 110}
    detail = reply_figures(reply, live=False)["tokens_per_s"][1]
    assert detail == "last reply · 9 tokens · prompt 120, 110 reused"
    assert "reused" not in reply_figures(reply, live=True)["tokens_per_s"][1]


def test_a_narrow_dashboard_in_its_scroll_area_grows_instead_of_drawing_tiles_over_each_other(
    qtbot, tmp_path, monkeypatch
):
    """The window at 1024×600 narrows the dock to one column of tiles: the dashboard asks for the
    height that needs, so its scroll area scrolls and each tile keeps its lines apart (at that size
    they were drawn over one another)."""
    from PySide6.QtWidgets import QApplication

    from app.gui.window.main_window import MainWindow

    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    window = MainWindow(client=None)
    qtbot.addWidget(window)
    window.resize(1024, 600)
    window.show()
    QApplication.processEvents()
    dashboard = window.dashboard
    assert dashboard.height() >= dashboard.minimumSizeHint().height()
    tile = dashboard.tiles["link"]
    assert tile.height() >= tile.minimumSizeHint().height()
    assert tile.detail.geometry().top() >= tile.value.geometry().bottom()
    window.close()
