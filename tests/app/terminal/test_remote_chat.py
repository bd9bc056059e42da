"""`moe-chat-cli --remote`: the terminal chat on a remote engine (a fake OpenAI server on 127.0.0.1),
its key from the environment, a cut reply shown, left out and retried, and the remote's /stats."""

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.remote_setup import open_remote_session, remote_endpoint
from app.settings.remotes import RemoteStore
from app.terminal.chat import TerminalChat, build_parser, format_stats
from engine.generation_config import GenerationConfig
from engine.remote.endpoint import RemoteEndpoint
from engine.remote.errors import RemoteError
from engine.remote.metrics import RemoteMetrics
from engine.remote.session import connect
from engine.remote.stats import remote_stats_event
from tests.engine.remote.fake_openai import FakeOpenAI, chunked, full_reply, sse_chunk

ROOT = Path(__file__).resolve().parents[3]


def test_the_cli_chats_with_a_remote_its_key_from_the_environment(tmp_path, monkeypatch):
    fake = FakeOpenAI(full_reply("Moo", "."), api_key="sk-env")
    args = ["--remote", fake.url, "--api-key-env", "LAB_KEY"]
    env = {**os.environ, "LAB_KEY": "sk-env", "MOE_CHAT_CONFIG_DIR": str(tmp_path)}
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("LAB_KEY", "sk-wrong")
    try:
        cli = [sys.executable, "-m", "app.terminal.chat", *args]
        ok = subprocess.run(cli, input="Hi\n", capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        with pytest.raises(RemoteError) as refused:  # the CLI shows this and exits with status 1
            open_remote_session(build_parser().parse_args(args), io.StringIO())
    finally:
        fake.stop()
    assert ok.returncode == 0 and ok.stdout == "Moo.\n", ok.stderr
    assert "Connected: fake-moe" in ok.stderr and "sk-env" not in ok.stderr + ok.stdout
    assert "refused the API key" in str(refused.value) and "sk-wrong" not in str(refused.value)


def test_a_cut_reply_is_shown_left_out_of_the_history_and_retried():
    fake = FakeOpenAI(chunked(sse_chunk("Mo"), end=False), full_reply("Moo", "."))
    session = connect(fake.url)
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        chat = TerminalChat(
            session, GenerationConfig(), None, io.StringIO("Hi\n/retry\n/retry\n"), stdout, stderr
        )
        assert chat.run() == 0
    finally:
        session.close()
        fake.stop()
    assert stdout.getvalue() == "Mo\nMoo.\n"
    assert "[reply interrupted:" in stderr.getvalue() and "/retry asks again" in stderr.getvalue()
    assert "Nothing to retry." in stderr.getvalue()  # the retry succeeded: nothing left to retry
    assert [r["messages"] for r in fake.requests] == [[{"role": "user", "content": "Hi"}]] * 2
    assert [m.content for m in chat.history] == ["Hi", "Moo."]


def test_a_saved_remote_is_found_by_name(tmp_path):
    store = RemoteStore(tmp_path / "remotes.json")
    store.save(RemoteEndpoint("lab", "http://gpu-box:8000", "deepseek-ai/DeepSeek-V3"))
    by_name = remote_endpoint(argparse.Namespace(remote="lab", model=None), store)
    assert by_name.base_url == "http://gpu-box:8000/v1" and by_name.model == "deepseek-ai/DeepSeek-V3"
    other = remote_endpoint(argparse.Namespace(remote="lab", model="Qwen/Qwen3-235B-A22B"), store)
    assert other.model == "Qwen/Qwen3-235B-A22B"
    assert remote_endpoint(argparse.Namespace(remote="h:1", model=None), store).base_url == "http://h:1/v1"


def test_remote_stats_show_the_servers_metrics_and_what_is_not_known():
    def stats(metrics):
        return remote_stats_event(
            "s",
            endpoint=RemoteEndpoint("lab", "http://gpu-box:8000"),
            model="m",
            generating=False,
            reply=None,
            metrics=metrics,
            host_ram=(1, 2),
            process_rss=1,
        )

    text = format_stats(stats(RemoteMetrics(engine="vllm", kv_cache_usage=0.375, requests_running=5.0)), None)
    assert "m on http://gpu-box:8000/v1 (vllm)" in text and "KV cache 38%" in text
    assert "requests running 5" in text and "accept_len n/a" in text and "expert balance n/a" in text
    text = format_stats(stats(RemoteMetrics(error="http://gpu-box:8000/metrics: HTTP 404")), None)
    assert "no server metrics" in text and "HTTP 404" in text
