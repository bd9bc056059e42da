"""ConversationStore: round trips, search, truncation, crash safety, damaged files, disk errors."""

import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from app.storage import (
    DEFAULT_TITLE,
    SCHEMA_VERSION,
    ConversationStore,
    StorageError,
    default_path,
    title_from,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path):
    with ConversationStore(tmp_path / "chats.sqlite3") as opened:
        yield opened


def test_default_path_follows_the_data_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path / "data"))
    assert default_path() == tmp_path / "data" / "conversations.sqlite3"
    with ConversationStore() as opened:
        assert opened.path == default_path() and opened.path.exists()


def test_messages_settings_and_prompt_round_trip(store, tmp_path):
    chat = store.create()
    assert chat.title == DEFAULT_TITLE and chat.messages == () and chat.settings == {}
    user = store.add_message(chat.id, "user", "Hello\nthere")
    stats = {"generated_tokens": 12, "tokens_per_s": 31.5, "accept_len": None}
    reply = store.add_message(chat.id, "assistant", "Hi! ```x```", stats)
    store.set_system_prompt(chat.id, "Be brief.")
    store.set_settings(chat.id, {"temperature": 0.2, "seed": None})
    store.close()

    with ConversationStore(tmp_path / "chats.sqlite3") as reopened:
        loaded = reopened.get(chat.id)
    assert loaded.messages == (user, reply)
    assert loaded.messages[1].stats == stats and loaded.messages[0].stats is None
    assert loaded.system_prompt == "Be brief." and loaded.settings == {"temperature": 0.2, "seed": None}
    assert loaded.updated_at == reply.created_at


def test_the_first_user_message_names_the_chat_unless_it_was_renamed(store):
    chat = store.create()
    store.add_message(chat.id, "assistant", "Greetings")
    store.add_message(
        chat.id, "user", "\n  How do   magnets work? And also a very long tail that goes on\nline 2"
    )
    store.add_message(chat.id, "user", "second question")
    title = store.get(chat.id).title
    assert title.startswith("How do magnets work?") and title.endswith("tail…") and len(title) <= 48

    renamed = store.create()
    store.rename(renamed.id, "Physics")
    store.add_message(renamed.id, "user", "How do magnets work?")
    assert store.get(renamed.id).title == "Physics"
    assert title_from("   \n ") == DEFAULT_TITLE


def test_list_is_newest_first_with_a_preview(store):
    first, second = store.create("First"), store.create("Second")
    assert [s.id for s in store.list()] == [second.id, first.id]
    store.add_message(first.id, "user", "a  reply\nspanning lines")
    summaries = store.list()
    assert [s.id for s in summaries] == [first.id, second.id]
    assert summaries[0].preview == "a reply spanning lines" and summaries[1].preview == ""
    store.rename(second.id, "Renamed")  # a rename is not activity: the order stays
    assert [s.id for s in store.list()] == [first.id, second.id]


def test_search_matches_title_and_content_ignoring_case(store):
    cooking, travel, other = store.create("Cooking"), store.create("Trip"), store.create("Other")
    store.add_message(travel.id, "user", "Plan a trip to ZÜRICH by train")
    store.add_message(other.id, "user", "100% sure? Use a_b")
    assert [s.id for s in store.list("cook")] == [cooking.id]
    assert [s.id for s in store.list("zürich")] == [travel.id]
    assert [s.id for s in store.list("TRAIN")] == [travel.id]
    assert [s.id for s in store.list("0%")] == [other.id]  # no LIKE wildcards leak through
    assert [s.id for s in store.list("a_b")] == [other.id]
    assert store.list("nothing like this") == []
    assert len(store.list("  ")) == 3


def test_delete_messages_from_removes_that_message_and_the_later_ones(store):
    chat, elsewhere = store.create(), store.create()
    ids = [store.add_message(chat.id, role, f"m{i}").id for i, role in enumerate(["user", "assistant"] * 3)]
    kept = store.add_message(elsewhere.id, "user", "untouched")
    store.delete_messages_from(chat.id, ids[3])
    assert [m.id for m in store.get(chat.id).messages] == ids[:3]
    assert store.get(elsewhere.id).messages == (kept,)
    with pytest.raises(KeyError):
        store.delete_messages_from(elsewhere.id, ids[0])  # not that conversation's message
    new = store.add_message(chat.id, "assistant", "again")
    assert new.id > ids[-1], "ids are never reused"


def test_update_message_keeps_stats_unless_new_ones_are_given(store):
    chat = store.create()
    reply = store.add_message(chat.id, "assistant", "part", {"generated_tokens": 1})
    updated = store.update_message(reply.id, "partial reply")
    assert updated.stats == {"generated_tokens": 1} and updated.content == "partial reply"
    final = store.update_message(reply.id, "partial reply, done", {"generated_tokens": 5})
    assert store.get(chat.id).messages == (final,)
    assert final.stats == {"generated_tokens": 5} and final.created_at == reply.created_at


def test_missing_ids_raise_key_error(store):
    chat = store.create()
    for call in (
        lambda: store.get(999),
        lambda: store.rename(999, "x"),
        lambda: store.delete(999),
        lambda: store.add_message(999, "user", "x"),
        lambda: store.update_message(999, "x"),
        lambda: store.set_settings(999, {}),
    ):
        with pytest.raises(KeyError):
            call()
    store.delete(chat.id)
    with pytest.raises(KeyError):
        store.get(chat.id)
    assert store.list() == []


def test_the_schema_is_versioned(store):
    version = sqlite3.connect(store.path).execute("PRAGMA user_version").fetchone()[0]
    assert version == SCHEMA_VERSION
    mode = sqlite3.connect(store.path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_a_file_from_a_newer_app_is_refused_not_replaced(tmp_path):
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(StorageError, match="newer MoE Chat") as raised:
        ConversationStore(path)
    assert raised.value.path == path and path.exists()
    assert list(tmp_path.iterdir()) == [path]


def test_a_committed_message_is_seen_by_another_connection_at_once(store):
    chat = store.create()
    store.add_message(chat.id, "user", "committed")
    other = sqlite3.connect(store.path)
    assert other.execute("SELECT content FROM messages").fetchall() == [("committed",)]
    other.close()


@pytest.mark.slow
def test_a_committed_message_survives_the_process_being_killed(tmp_path):
    path = tmp_path / "chats.sqlite3"
    child = (
        "import os, signal, sys\n"
        "from app.storage import ConversationStore\n"
        "store = ConversationStore(__import__('pathlib').Path(sys.argv[1]))\n"
        "chat = store.create()\n"
        "store.add_message(chat.id, 'user', 'before the crash')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = subprocess.run([sys.executable, "-c", child, str(path)], cwd=ROOT, check=False)
    assert result.returncode == -9, "the child must die without closing the store"
    with ConversationStore(path) as reopened:
        (summary,) = reopened.list()
        assert [m.content for m in reopened.get(summary.id).messages] == ["before the crash"]


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_file_is_moved_aside_and_a_new_one_created(tmp_path, caplog, damage):
    path = tmp_path / "chats.sqlite3"
    if damage == "garbage":
        path.write_bytes(b"this is not a database at all" * 100)
    else:
        with ConversationStore(path) as original:
            chat = original.create()
            for i in range(200):
                original.add_message(chat.id, "user", f"message {i} " * 50)
        data = path.read_bytes()
        path.write_bytes(data[:4096] + b"\x00\xff" * 6000 + data[16096:])
    before = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="app.storage"), ConversationStore(path) as fresh:
        assert fresh.list() == []
        fresh.create()
    moved = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name and not p.name.endswith(("-wal", "-shm"))]
    assert len(moved) == 1 and moved[0].read_bytes() == before
    assert "moved it to" in caplog.text and str(path) in caplog.text


def test_a_full_disk_raises_storage_error_and_rolls_back(store):
    chat = store.create()
    store.add_message(chat.id, "user", "fits")
    page_count = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count={page_count + 1}")  # white box: a full disk
    with pytest.raises(StorageError, match="full") as raised:
        store.add_message(chat.id, "assistant", "x" * 200_000)
    assert raised.value.path == store.path and str(store.path) in str(raised.value)
    assert [m.content for m in store.get(chat.id).messages] == ["fits"]
    store._conn.execute("PRAGMA max_page_count=1073741823")
    store.add_message(chat.id, "assistant", "room again")
    assert len(store.get(chat.id).messages) == 2


def test_a_folder_that_cannot_be_created_raises_storage_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StorageError, match="Cannot create the folder") as raised:
        ConversationStore(blocker / "chats.sqlite3")
    assert raised.value.path == blocker / "chats.sqlite3"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores file permissions")
def test_a_read_only_folder_raises_storage_error(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(StorageError, match=str(folder)):
            ConversationStore(folder / "chats.sqlite3")
    finally:
        folder.chmod(0o700)


def test_a_read_only_file_raises_storage_error_on_write(tmp_path, monkeypatch):
    path = tmp_path / "chats.sqlite3"
    with ConversationStore(path) as original:
        chat = original.create()
    store = ConversationStore(path)
    store._conn.execute("PRAGMA query_only=ON")  # white box: what a read-only mount does to writes
    with pytest.raises(StorageError, match="Could not save") as raised:
        store.add_message(chat.id, "user", "lost?")
    assert raised.value.path == path
    assert store.get(chat.id).messages == ()
    store.close()


V1_SCHEMA = """
CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '', settings TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL, content TEXT NOT NULL, stats TEXT, created_at REAL NOT NULL);
INSERT INTO conversations VALUES (1, 'Cows', '', '{}', 1.0, 2.0);
INSERT INTO messages VALUES (1, 1, 'user', 'Moo?', NULL, 1.0);
INSERT INTO messages VALUES (2, 1, 'assistant', 'Moo.', '{"generated_tokens": 2}', 2.0);
PRAGMA user_version = 1;
"""


def test_a_version_1_file_keeps_its_chats_and_gains_the_reasoning_column(tmp_path):
    path = tmp_path / "conversations.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.executescript(V1_SCHEMA)
    store = ConversationStore(path)
    try:
        old = store.get(1).messages
        assert [(m.content, m.reasoning) for m in old] == [("Moo?", ""), ("Moo.", "")]
        kept = store.add_message(1, "assistant", "Moo!", {"thinking_tokens": 3}, reasoning="Cows moo.")
        assert store.get(1).messages[-1] == kept and kept.reasoning == "Cows moo."
    finally:
        store.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 2
