"""The local server switched on from the window, with the window's worker on the demo model: the
official `openai` client gets replies (whole and streamed, chat and completions) while the chat
goes on, so does the `ollama` client, the key is asked for, the request log shows each request,
and switching it off closes the port."""

import socket
import threading

import ollama
import openai
import pytest

from app.gui.engine.engine_client import ReplyText
from app.gui.window.main_window import MainWindow
from app.session_setup import DEMO_MODEL_ID
from app.settings import AppSettings
from app.settings.server_prefs import SERVER_FILE, ServerPrefs, ServerPrefsStore
from tests.screenshots import save_screenshot

pytestmark = [pytest.mark.gui, pytest.mark.slow]

START_MS = 90_000
KEY = "sk-local-test"
COW = [{"role": "user", "content": "What sound does a cow make?"}]


@pytest.fixture
def dirs(tmp_path, monkeypatch, memory_keyring):
    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def open_window(qtbot) -> MainWindow:
    window = MainWindow()
    qtbot.addWidget(window)
    window.settings = AppSettings(device="cpu")
    window.show()
    with qtbot.waitSignal(window.client.sig_loaded, timeout=START_MS):
        window.start_engine()
    return window


def in_thread(qtbot, call, timeout_ms: int = 60_000):
    """Run a blocking client call off the GUI thread (the window must keep serving it)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except Exception as err:
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=timeout_ms)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_the_window_serves_its_model_to_the_openai_client_beside_the_chat(qtbot, dirs, tmp_path):
    window = open_window(qtbot)
    panel, port = window.server_panel, free_port()
    window.open_server_panel()
    panel.port.setValue(port)
    panel.api_key.setText(KEY)
    panel.switch.click()
    assert window.local_server.running and panel.switch.text() == "Stop the server"
    url = f"http://127.0.0.1:{port}/v1"
    assert panel.address.text() == url and DEMO_MODEL_ID in panel.example.toPlainText()
    assert f"use {url.removesuffix('/v1')} as the Ollama address" in panel.example.toPlainText()
    assert f"Server on at {url}" in window.server_label.text()
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)

    assert [m.id for m in in_thread(qtbot, client.models.list).data] == [DEMO_MODEL_ID]
    reply = in_thread(
        qtbot, lambda: client.chat.completions.create(model=DEMO_MODEL_ID, messages=COW, temperature=0)
    )
    assert reply.choices[0].message.content == "A cow says moo." and reply.usage.completion_tokens > 0

    # a streamed request while the chat streams its own reply: both end whole
    window.new_conversation()
    window.store.set_settings(window.session.conversation_id, {"temperature": 0.0, "max_new_tokens": 64})
    chat_texts = []
    window.client.sig_reply.connect(lambda e: chat_texts.append(e) if isinstance(e, ReplyText) else None)
    with qtbot.waitSignal(window.session.sig_reply_ended, timeout=120_000) as chat_done:
        window.chat_view.sig_send.emit("What sound does a cow make?")
        stream = in_thread(
            qtbot,
            lambda: "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    model=DEMO_MODEL_ID, messages=COW, temperature=0, stream=True
                )
                if c.choices
            ),
            120_000,
        )
    assert stream == "A cow says moo." and chat_done.args[0].finished.text == "A cow says moo."
    assert window.session.conversation().messages[-1].content == "A cow says moo."

    with pytest.raises(openai.AuthenticationError):
        in_thread(qtbot, openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0).models.list)
    completed = in_thread(
        qtbot,
        lambda: client.completions.create(
            model=DEMO_MODEL_ID, prompt="Once upon a time", max_tokens=4, temperature=0, echo=True
        ),
    )
    assert completed.choices[0].text.startswith("Once upon a time"), "a prompt as written, echoed"
    host = url.removesuffix("/v1")
    with ollama.Client(host=host, headers={"Authorization": f"Bearer {KEY}"}) as ollama_client:
        options = {"temperature": 0}
        said = in_thread(
            qtbot, lambda: ollama_client.chat(model=DEMO_MODEL_ID, messages=COW, options=options)
        )
        assert said.message.content == "A cow says moo."
        assert in_thread(qtbot, lambda: ollama_client.show(DEMO_MODEL_ID)).details.family == "qwen3_moe"
    log = panel.log.toPlainText()
    assert "POST /v1/chat/completions 200" in log and "GET /v1/models 401" in log
    assert "POST /v1/completions 200" in log and "POST /api/chat 200" in log
    assert f"{DEMO_MODEL_ID}: " in log and "generated" in log, "each reply's figures are logged"
    save_screenshot(window, "server_dock.png", tmp_path)

    panel.switch.click()
    assert not window.local_server.running and panel.switch.text() == "Start the server"
    with pytest.raises(openai.APIConnectionError):
        in_thread(qtbot, client.models.list)
    assert not window.server_label.isVisible()
    window.close()


def test_a_request_while_the_model_reloads_waits_for_none_and_gets_a_503(qtbot, dirs):
    window = open_window(qtbot)
    port = free_port()
    window.server_panel.port.setValue(port)
    assert window.server_panel.start_server()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    window.load_model()  # the same model again: until it is loaded, the server says so
    with pytest.raises(openai.APIStatusError) as refused:
        in_thread(qtbot, lambda: client.chat.completions.create(model=DEMO_MODEL_ID, messages=COW))
    assert refused.value.status_code == 503 and "No model is loaded" in str(refused.value)
    qtbot.waitUntil(lambda: window.model_info is not None, timeout=START_MS)
    reply = in_thread(
        qtbot, lambda: client.chat.completions.create(model=DEMO_MODEL_ID, messages=COW, temperature=0)
    )
    assert reply.choices[0].message.content == "A cow says moo."
    window.close()
    assert not window.local_server.running


def test_the_server_starts_with_the_app_when_asked_and_says_when_its_port_is_taken(qtbot, dirs):
    store = ServerPrefsStore(dirs / "config" / SERVER_FILE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        store.save(ServerPrefs(taken.getsockname()[1], start_with_app=True))
        window = MainWindow()
        qtbot.addWidget(window)
        assert not window.local_server.running and not window.server_panel.switch.isChecked()
        assert "Could not listen on port" in window.server_panel.status.text()
    store.save(ServerPrefs(free_port(), start_with_app=True))
    again = MainWindow()
    qtbot.addWidget(again)
    assert again.local_server.running and again.server_panel.start_with_app.isChecked()
    again.close()
    window.close()
