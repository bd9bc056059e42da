"""Saved remote engines: listed, saved, switched and deleted in remotes.json; their API keys only
in the keyring (or this run's memory where there is none), never in a file or the log."""

import json
import logging

import pytest

import app.settings.secrets as secrets
from app.settings.remotes import RemoteStore
from app.settings.secrets import IN_KEYRING, REMOTE_KEYRING_SERVICE, SESSION_ONLY, ApiKeys
from engine.errors import InvalidConfigError
from engine.remote.endpoint import RemoteEndpoint

LAB = RemoteEndpoint("lab", "http://gpu-box:8000", "deepseek-ai/DeepSeek-V3")
HOME = RemoteEndpoint("home", "https://llm.example/v1")


def test_remotes_are_saved_switched_and_deleted_with_their_keys(tmp_path, memory_keyring, caplog):
    caplog.set_level(logging.DEBUG)
    store = RemoteStore(tmp_path / "remotes.json")
    assert store.remotes() == [] and store.active() is None
    assert store.save(LAB, api_key=" sk-lab-secret\n") == IN_KEYRING
    store.save(HOME)
    store.set_active("lab")
    again = RemoteStore(tmp_path / "remotes.json")
    assert again.remotes() == [LAB, HOME] and again.active() == LAB
    assert again.key(LAB) == "sk-lab-secret" and again.key(HOME) is None
    assert memory_keyring.passwords == {(REMOTE_KEYRING_SERVICE, "http://gpu-box:8000/v1"): "sk-lab-secret"}
    assert "sk-lab-secret" not in (tmp_path / "remotes.json").read_text()
    assert "sk-lab-secret" not in caplog.text
    store.save(RemoteEndpoint("lab", "http://gpu-box:8000", "Qwen/Qwen3-235B-A22B"))  # a new default model
    assert store.get("lab").model == "Qwen/Qwen3-235B-A22B" and store.key(LAB) == "sk-lab-secret"
    store.delete("lab")
    assert store.remotes() == [HOME] and store.active() is None and memory_keyring.passwords == {}
    with pytest.raises(InvalidConfigError, match="lab"):
        store.set_active("lab")


def test_a_worker_factory_gives_a_remote_worker_with_the_key(tmp_path, memory_keyring):
    store = RemoteStore(tmp_path / "remotes.json")
    store.save(LAB, api_key="sk-1")
    worker = store.worker_factory("lab")()
    assert worker.endpoint == LAB and worker._api_key == "sk-1" and "sk-1" not in repr(worker)
    assert not worker.alive  # not started: the EngineClient's reader thread starts it


def test_without_a_keyring_a_key_lasts_this_run_only(monkeypatch, caplog):
    monkeypatch.setattr(secrets, "system_keyring", lambda: None)
    keys = ApiKeys()
    assert keys.set("http://h/v1", "sk-x") == SESSION_ONLY and "keyring" in SESSION_ONLY
    assert keys.get("http://h/v1") == "sk-x" and ApiKeys().get("http://h/v1") is None
    keys.delete("http://h/v1")
    assert keys.get("http://h/v1") is None and "sk-x" not in caplog.text
    with pytest.raises(ValueError, match="empty"):
        keys.set("http://h/v1", "  ")


def test_a_damaged_file_lists_what_it_can(tmp_path):
    path = tmp_path / "remotes.json"
    entries = [
        {"name": "ok", "base_url": "http://a:1"},
        {"name": "bad", "base_url": "ftp://b"},
        {"base_url": "http://c"},
        {"name": "ok", "base_url": "http://d"},
    ]
    path.write_text(json.dumps({"version": 1, "remotes": entries, "active": "gone"}))
    store = RemoteStore(path)
    assert [r.name for r in store.remotes()] == ["ok"] and store.active() is None
    assert len(store.problems) == 3
    path.write_text("{not json")
    assert store.remotes() == [] and "Cannot read" in store.problems[0]
