"""Remote engines in the window: the picker's Remote tab, Settings' engine choice, a chat answered by
an OpenAI-compatible server on 127.0.0.1 (a cut stream kept and marked), the remote dashboard."""

import json

import pytest

from app.gui.chat.chat_session import FinishReason
from app.gui.dashboard.remote_dashboard import NOT_EXPORTED, RemotePanel
from app.gui.models.remote_page import RemotePage
from app.gui.settings.settings_dialog import SettingsDialog
from app.gui.window.main_window import MainWindow
from app.settings import AppSettings
from app.settings.remotes import RemoteStore
from engine.remote.endpoint import RemoteEndpoint
from engine.remote.metrics import RemoteMetrics, parse_metrics
from engine.remote.stats import RemoteStats
from tests.engine.remote.fake_openai import FakeOpenAI, chunked, full_reply, sse_chunk
from tests.screenshots import save_screenshot

pytestmark = pytest.mark.gui

KEY = "sk-remote-secret"
GREEDY = {"temperature": 0.0, "max_new_tokens": 16}


@pytest.fixture
def fake():
    cut = chunked(sse_chunk("Half a"), end=False)
    server = FakeOpenAI(full_reply("Hello", " from", " afar."), cut, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


def test_the_remote_tab_fetches_models_saves_the_key_in_the_keyring_and_chooses(
    qtbot, tmp_path, fake, memory_keyring
):
    store = RemoteStore(tmp_path / "remotes.json")
    page = RemotePage(store)
    qtbot.addWidget(page)
    page.name.setText("lab")
    page.address.setText(fake.url.removesuffix("/v1"))
    page.api_key.setText("sk-wrong")
    page.fetch_models()
    qtbot.waitUntil(lambda: page.fetch_button.isEnabled(), timeout=20_000)
    assert "401" in page.status.text() or "key" in page.status.text().lower()
    page.api_key.setText(KEY)
    page.fetch_models()
    qtbot.waitUntil(lambda: page.model.count() == 1, timeout=20_000)
    assert page.model.currentText() == "fake-moe"
    assert page.save() == RemoteEndpoint("lab", fake.url, "fake-moe")
    assert store.key(store.get("lab")) == KEY and KEY not in (tmp_path / "remotes.json").read_text()
    assert [page.table.item(0, c).text() for c in range(4)] == ["lab", fake.url, "fake-moe", "kept"]
    page.table.selectRow(0)
    with qtbot.waitSignal(page.sig_engine_chosen) as chosen:
        page.use_button.click()
    assert chosen.args == ["lab"]
    page.address.setText("ftp://nowhere")
    assert page.save() is None and "not a server address" in page.status.text()


def test_settings_switch_between_the_local_and_a_saved_engine(qtbot, tmp_path, memory_keyring):
    store = RemoteStore(tmp_path / "remotes.json")
    store.save(RemoteEndpoint("lab", "http://gpu-box:8000"))
    dialog = SettingsDialog(AppSettings(device="cpu"), remotes=store)
    qtbot.addWidget(dialog)
    assert dialog.engine.currentData() is None and dialog.engine.count() == 2
    dialog.engine.setCurrentIndex(dialog.engine.findData("lab"))
    with qtbot.waitSignal(dialog.sig_engine_chosen) as chosen:
        assert dialog.apply()
    assert chosen.args == ["lab"]
    with qtbot.assertNotEmitted(dialog.sig_engine_chosen):
        assert dialog.apply()  # nothing changed since: no second switch


def test_a_chat_with_a_remote_engine_keeps_a_cut_reply_and_offers_retry(qtbot, dirs, fake, memory_keyring):
    window = MainWindow()
    qtbot.addWidget(window)
    window.remotes.save(RemoteEndpoint("lab", fake.url), api_key=KEY)
    window.settings = AppSettings(device="cpu")
    window.show()
    with qtbot.waitSignal(window.client.sig_loaded, timeout=30_000):
        window.use_engine("lab")
    assert window.model_info["remote"] and window.model_info["name"] == "fake-moe · lab"
    assert "remote" in window.engine_label.text()
    assert window.dashboard.remote_panel.isVisibleTo(window.dashboard)
    assert not window.dashboard.tiles["vram"].isVisibleTo(window.dashboard)
    window.new_conversation()
    window.store.set_settings(window.session.conversation_id, GREEDY)
    with qtbot.waitSignal(window.session.sig_reply_ended, timeout=30_000) as done:
        window.chat_view.sig_send.emit("Hi there")
    assert done.args[0].reason is FinishReason.EOS and done.args[0].text == "Hello from afar."
    assert fake.requests[-1]["messages"][-1] == {"role": "user", "content": "Hi there"}
    with qtbot.waitSignal(window.session.sig_reply_ended, timeout=30_000) as done:
        window.chat_view.sig_send.emit("And then?")
    cut = done.args[0]
    assert cut.reason is FinishReason.CUT and cut.text == "Half a"
    stored = window.session.conversation().messages[-1]
    assert stored.content == "Half a" and stored.stats["finish_reason"] == "interrupted"
    assert isinstance(stored.stats["error"], str) and stored.stats["error"]
    banners = [b for b in window.banners.banners() if b.key == "reply"]
    assert len(banners) == 1 and "kept" in banners[0].message
    assert [button.text() for button in banners[0].action_buttons] == ["Retry"]
    qtbot.waitUntil(lambda: window.dashboard.remote_panel.text("ttft") != "n/a", timeout=10_000)
    assert window.dashboard.remote_panel.tiles["kv_cache"].detail.text() == NOT_EXPORTED
    save_screenshot(window, "remote_chat.png", dirs)
    window.open_tune_wizard()
    assert any("local engine" in b.message for b in window.banners.banners() if b.key == "tune")
    with qtbot.waitSignal(window.client.sig_loaded, timeout=120_000):
        window.use_engine(None)  # back to this computer: the demo model loads
    assert not window.model_info.get("remote") and window.remotes.active() is None
    window.close()


def test_an_unreachable_remote_is_a_banner_with_choices_not_a_restart_loop(qtbot, dirs, memory_keyring):
    import socket

    with socket.socket() as probe:  # a port nothing listens on: connections are refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    window = MainWindow()
    qtbot.addWidget(window)
    window.remotes.save(RemoteEndpoint("down", f"http://127.0.0.1:{port}"))
    starts = []
    window.client.sig_state_changed.connect(
        lambda state: starts.append(state.value) if state.value == "starting" else None
    )
    window.show()
    with qtbot.waitSignal(window.client.sig_worker_died, timeout=30_000) as died:
        window.use_engine("down")
    assert "127.0.0.1" in died.args[0]
    qtbot.wait(1500)  # a restart loop would start again and again meanwhile
    assert starts == ["starting"] and window.model_info is None
    banners = [b for b in window.banners.banners() if b.key == "engine"]
    labels = [button.text() for button in banners[0].action_buttons]
    assert labels == ["Retry", "Use the local engine", "Remote engines…"]
    with qtbot.waitSignal(window.client.sig_worker_died, timeout=30_000):
        banners[0].action_buttons[0].click()  # Retry: one more try, on the user's word
    assert starts == ["starting", "starting"]
    window.close()


VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.42
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 300.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 400.0
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{model_name="m"} 100.0
"""


def test_the_remote_panel_shows_vllm_figures_and_na_for_what_is_not_exported(qtbot):
    panel = RemotePanel()
    qtbot.addWidget(panel)
    stats = RemoteStats("lab", "http://gpu:8000/v1", "m", ttft_ms=180.0, tokens_per_s=42.5, tpot_ms=23.5,
                        generated_tokens=64, metrics=parse_metrics(VLLM))  # fmt: skip
    panel.show_stats(stats, time_s=1.0)
    assert panel.text("ttft") == "180 ms" and panel.text("tokens_per_s") == "42.5 tok/s"
    assert panel.text("kv_cache") == "42.0 %" and panel.text("requests") == "3 / 1"
    assert panel.text("accept") == "4.00 tokens" and "75.0 %" in panel.tiles["accept"].detail.text()
    assert panel.text("ep_balance") == "n/a" and panel.tiles["ep_balance"].detail.text() == NOT_EXPORTED
    assert "vllm server" in panel.source.text()
    panel.show_stats(RemoteStats("lab", "http://gpu:8000/v1", "m", metrics=RemoteMetrics(error="404")))
    assert panel.text("kv_cache") == "n/a" and "cannot be read (404)" in panel.source.text()
    assert panel.tiles["ttft"].detail.text() == "no reply yet"
    assert json.dumps(stats.metrics.to_dict())  # what the worker sends is plain data
