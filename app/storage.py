"""Conversations kept on disk in one SQLite file.

`ConversationStore` owns one connection, used from the thread that made it
(the GUI thread). Every change is one
transaction (`BEGIN IMMEDIATE … COMMIT`) in WAL mode with `synchronous=FULL`:
each commit is fsynced to the WAL before the call returns, so a committed
message survives a crash of the app *and* of the machine. NORMAL would survive
an app crash but may roll back the last commits on power loss; a chat writes a
handful of times per reply (never per token), so the extra fsync costs nothing
anyone sees.

The schema is versioned with `PRAGMA user_version`. A file that is not a
database or is corrupt is renamed aside (`….corrupt-YYYYmmdd-HHMMSS`) and a fresh
one created, with a logged warning; a file from a newer version of the app is
refused. A disk that is read-only, full or failing raises `StorageError` naming
the path; the store stays usable once the cause is gone.

Ids are never reused. A missing conversation or message raises `KeyError`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import platformdirs

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2  # 2: messages.reasoning
DEFAULT_TITLE = "New chat"
FILE_NAME = "conversations.sqlite3"
TITLE_CHARS = 48
PREVIEW_CHARS = 80
_CORRUPT_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}

_SCHEMA = """
CREATE TABLE conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stats TEXT,
    created_at REAL NOT NULL,
    reasoning TEXT NOT NULL DEFAULT ''
);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
CREATE INDEX conversations_by_update ON conversations(updated_at DESC);
"""


class StorageError(Exception):
    """The conversation file cannot be read or written (read-only or full disk, I/O error…)."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: str  # user | assistant
    content: str
    stats: dict | None  # the reply's GenerationStats dict (assistant messages)
    created_at: float
    reasoning: str = ""  # the model's thinking before its answer (shown apart, never sent back)


@dataclass(frozen=True)
class ConversationSummary:
    id: int
    title: str
    updated_at: float
    preview: str  # the start of the newest message, on one line


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    settings: dict
    messages: tuple[StoredMessage, ...]
    updated_at: float


def default_path() -> Path:
    """`<user data dir>/conversations.sqlite3`; MOE_CHAT_DATA_DIR overrides the folder."""
    folder = os.environ.get("MOE_CHAT_DATA_DIR") or platformdirs.user_data_dir("MoE Chat", appauthor=False)
    return Path(folder) / FILE_NAME


def title_from(text: str) -> str:
    """A chat title from the first user message: its first line, shortened."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    line = re.sub(r"\s+", " ", line)
    if not line:
        return DEFAULT_TITLE
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


def _one_line(text: str, limit: int) -> str:
    flat = re.sub(r"\s+", " ", text).strip()
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _contains(haystack: str | None, needle: str) -> bool:
    return haystack is not None and needle in haystack.casefold()


class ConversationStore:
    """Conversations and their messages in one SQLite file (see the module docstring)."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else default_path()
        self._last_time = 0.0
        self._conn = self._open()

    # ---- opening ---------------------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"Cannot create the folder for {self.path}: {exc}", self.path) from exc
        try:
            return self._connect()
        except sqlite3.Error as exc:
            if getattr(exc, "sqlite_errorcode", None) not in _CORRUPT_CODES:
                raise self._error("open", exc) from exc
            self._move_aside(exc)
        try:
            return self._connect()
        except sqlite3.Error as exc:
            raise self._error("create", exc) from exc

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None)  # transactions are explicit
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.execute("PRAGMA busy_timeout=5000")
            conn.create_function("moe_contains", 2, _contains, deterministic=True)
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                error = sqlite3.DatabaseError(f"quick_check: {check}")
                error.sqlite_errorcode = sqlite3.SQLITE_CORRUPT
                raise error
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StorageError(
                f"{self.path} was written by a newer MoE Chat (schema {version}, this one knows "
                f"{SCHEMA_VERSION}); update the app or move the file away.",
                self.path,
            )
        if version == SCHEMA_VERSION:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            if version == 0:  # statement by statement: executescript() would commit early
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    conn.execute(statement)
            elif version == 1:
                conn.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _move_aside(self, cause: Exception) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        attempt = 1
        while target.exists():  # damaged twice within a second: keep both
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{attempt}")
            attempt += 1
        for suffix in ("", "-wal", "-shm"):
            source = Path(f"{self.path}{suffix}")
            if source.exists():
                try:
                    source.rename(Path(f"{target}{suffix}"))
                except OSError as exc:
                    raise StorageError(
                        f"{self.path} is damaged and cannot be moved aside: {exc}", self.path
                    ) from exc
        log.warning("%s was damaged (%s); moved it to %s and started a new one", self.path, cause, target)

    # ---- plumbing --------------------------------------------------------------------------------

    def _error(self, action: str, exc: BaseException) -> StorageError:
        return StorageError(f"Could not {action} the conversations in {self.path}: {exc}", self.path)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; any SQLite failure becomes a `StorageError` and is rolled back."""
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise self._error("save", exc) from exc
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise self._error("save", exc) from exc
            raise

    def _read(self, sql: str, params: tuple | dict = ()) -> list[tuple]:
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise self._error("read", exc) from exc

    def _now(self) -> float:
        # Strictly increasing, so "newest first" is well defined even within one clock tick.
        self._last_time = max(time.time(), self._last_time + 1e-6)
        return self._last_time

    @staticmethod
    def _require(conn: sqlite3.Connection, table: str, row_id: int) -> None:
        if conn.execute(f"SELECT 1 FROM {table} WHERE id = ?", (row_id,)).fetchone() is None:
            raise KeyError(f"no {table[:-1]} with id {row_id}")

    # ---- conversations ---------------------------------------------------------------------------

    def create(self, title: str = DEFAULT_TITLE) -> Conversation:
        """A new, empty conversation."""
        now = self._now()
        with self._transaction() as conn:
            cursor = conn.execute(
                "INSERT INTO conversations (title, created_at, updated_at) VALUES (?, ?, ?)",
                (title, now, now),
            )
        return Conversation(cursor.lastrowid, title, "", {}, (), now)

    def list(self, search: str = "") -> list[ConversationSummary]:
        """Summaries, newest first; `search` matches title or any message, ignoring case."""
        needle = search.strip().casefold()
        where = (
            "WHERE moe_contains(c.title, :q) OR EXISTS (SELECT 1 FROM messages s"
            " WHERE s.conversation_id = c.id AND moe_contains(s.content, :q))"
            if needle
            else ""
        )
        rows = self._read(
            "SELECT c.id, c.title, c.updated_at, (SELECT m.content FROM messages m"
            " WHERE m.conversation_id = c.id ORDER BY m.id DESC LIMIT 1)"
            f" FROM conversations c {where} ORDER BY c.updated_at DESC, c.id DESC",
            {"q": needle},
        )
        return [
            ConversationSummary(cid, title, updated, _one_line(last or "", PREVIEW_CHARS))
            for cid, title, updated, last in rows
        ]

    def get(self, conversation_id: int) -> Conversation:
        """The whole conversation; `KeyError` if there is none with this id."""
        head = self._read(
            "SELECT title, system_prompt, settings, updated_at FROM conversations WHERE id = ?",
            (conversation_id,),
        )
        if not head:
            raise KeyError(f"no conversation with id {conversation_id}")
        title, system_prompt, settings, updated_at = head[0]
        columns = "id, role, content, stats, created_at, reasoning"
        rows = self._read(
            f"SELECT {columns} FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,)
        )
        messages = tuple(StoredMessage(m, r, c, _load_json(s, None), t, why) for m, r, c, s, t, why in rows)
        return Conversation(
            conversation_id, title, system_prompt, _load_json(settings, {}), messages, updated_at
        )

    def rename(self, conversation_id: int, title: str) -> None:
        self._update_conversation(conversation_id, "title", title.strip() or DEFAULT_TITLE)

    def set_system_prompt(self, conversation_id: int, text: str) -> None:
        self._update_conversation(conversation_id, "system_prompt", text)

    def set_settings(self, conversation_id: int, settings: dict) -> None:
        self._update_conversation(conversation_id, "settings", json.dumps(settings))

    def _update_conversation(self, conversation_id: int, column: str, value: str) -> None:
        with self._transaction() as conn:
            self._require(conn, "conversations", conversation_id)
            conn.execute(f"UPDATE conversations SET {column} = ? WHERE id = ?", (value, conversation_id))

    def delete(self, conversation_id: int) -> None:
        """Delete a conversation and its messages."""
        with self._transaction() as conn:
            self._require(conn, "conversations", conversation_id)
            conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ---- messages --------------------------------------------------------------------------------

    def add_message(
        self, conversation_id: int, role: str, content: str, stats: dict | None = None, reasoning: str = ""
    ) -> StoredMessage:
        """Append a message (a reply with its `reasoning`); a first user message names a new chat."""
        now = self._now()
        with self._transaction() as conn:
            self._require(conn, "conversations", conversation_id)
            cursor = conn.execute(
                "INSERT INTO messages (conversation_id, role, content, stats, created_at, reasoning)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, _dump_json(stats), now, reasoning),
            )
            conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
            if role == "user":
                conn.execute(
                    "UPDATE conversations SET title = ? WHERE id = ? AND title = ?",
                    (title_from(content), conversation_id, DEFAULT_TITLE),
                )
        return StoredMessage(cursor.lastrowid, role, content, stats, now, reasoning)

    def update_message(self, message_id: int, content: str, stats: dict | None = None) -> StoredMessage:
        """Replace a message's text (and its stats, unless `stats` is None: then they are kept)."""
        now = self._now()
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT conversation_id, role, stats, created_at, reasoning FROM messages WHERE id = ?",
                (message_id,),
            ).fetchone()
            if row is None:
                raise KeyError(f"no message with id {message_id}")
            conversation_id, role, old_stats, created_at, reasoning = row
            new_stats = _dump_json(stats) if stats is not None else old_stats
            conn.execute(
                "UPDATE messages SET content = ?, stats = ? WHERE id = ?", (content, new_stats, message_id)
            )
            conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))
        return StoredMessage(message_id, role, content, _load_json(new_stats, None), created_at, reasoning)

    def delete_messages_from(self, conversation_id: int, message_id: int) -> None:
        """Delete this message of the conversation and every later one (regenerate, edit and resend)."""
        now = self._now()
        with self._transaction() as conn:
            row = conn.execute("SELECT conversation_id FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None or row[0] != conversation_id:
                raise KeyError(f"no message {message_id} in conversation {conversation_id}")
            conn.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND id >= ?", (conversation_id, message_id)
            )
            conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conversation_id))

    # ---- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the file; the store cannot be used afterwards."""
        with contextlib.suppress(sqlite3.Error):
            self._conn.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _dump_json(value: dict | None) -> str | None:
    return None if value is None else json.dumps(value)


def _load_json(text: str | None, default):
    if text is None:
        return default
    try:
        return json.loads(text)
    except ValueError:
        log.warning("ignoring unreadable JSON in the conversation store: %.80r", text)
        return default
