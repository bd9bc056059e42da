"""The open conversation and its reply in flight, between the store, the engine client and the view.

A reply is one `Reply` from its request to its end. Its events come on one path,
the client's `sig_reply` (`ReplyText`s, then one `Finished`, `Error` or
`WorkerCrashed`), to one handler; the app's own reasons to let a reply go (another
conversation opened, the conversation deleted, the engine restarted, the app
closed) end it through the same `_end`. `_end` records the `FinishReason` on
the reply, stores it, shows it and emits `sig_reply_ended` once; the window
picks its banner from the reason.

Order of writes keeps the user's words safe: the user's message is stored
before it is sent; a reply is stored when it ends, whole when the engine
finished it, else with what had streamed so far and why it ended.
Regenerate and edit-and-resend delete the stored tail first, then send again.

An interrupted reply (the worker crashed, the engine failed, the app let it go) is
its own entry, marked `finish_reason: "interrupted"` with the reason; a crash is
recorded even when nothing had streamed. Regenerate keeps it and adds the new reply
as a separate entry below it (the view is refreshed from the store first, so a
failed reply's bubble never runs into the next one), and the model is not shown it:
an interrupted entry is context only when the user answered it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QObject, Signal

from app.gui.chat.chat_settings import sampling_from, template_kwargs_from
from app.gui.chat.chat_view import ChatView
from app.gui.chat.thinking import Thinking
from app.gui.engine.engine_client import EngineClient, ReplyEvent, ReplyText, WorkerCrashed
from app.settings import AppSettings
from app.storage import Conversation, ConversationStore, StoredMessage
from engine.worker.protocol import ChatMessage, Error, Finished

log = logging.getLogger(__name__)


class FinishReason(enum.Enum):
    """Why a reply ended: the engine's reasons (`Finished.reason`), then the app's own."""

    EOS = "eos"  # the model ended it
    STOP = "stop"  # a stop string
    LENGTH = "length"  # the token limit
    CANCELLED = "cancelled"  # the user pressed Stop
    TOOL_CALLS = "tool_calls"  # a remote engine's model called a tool (the chat window offers none)
    CUT = "interrupted"  # a remote engine's stream was cut: the part received is kept, marked
    ERROR = "error"  # the engine failed the request
    CRASHED = "crashed"  # the worker died mid-reply
    ABANDONED = "abandoned"  # the app let it go: another conversation, a restart, closing the app
    DISCARDED = "discarded"  # its conversation was deleted: nothing is kept


INTERRUPTED = "interrupted"  # the stored finish_reason of a reply the engine did not finish


def is_interrupted(message: StoredMessage) -> bool:
    return message.role == "assistant" and (message.stats or {}).get("finish_reason") == INTERRUPTED


def context_messages(messages: list[StoredMessage]) -> list[StoredMessage]:
    """What the model is shown: every message but an interrupted reply that no user message answered
    (one a reply was regenerated after, or the last)."""
    return [
        message
        for message, after in zip(messages, [*messages[1:], None], strict=True)
        if not is_interrupted(message) or (after is not None and after.role == "user")
    ]


def context_text(used: int | None, window: int | None) -> str:
    """The status bar's "Context 1,234 / 32,768 tokens" ("" before a reply)."""
    if used is None:
        return ""
    return f"Context {used:,} / {window:,} tokens" if window else f"Context {used:,} tokens"


@dataclass
class Reply:
    """One reply, from its request to its end; `reason` stays None while it streams."""

    request_id: str
    conversation_id: int
    streamed: list[str] = field(default_factory=list)  # the text chunks so far
    thought: list[str] = field(default_factory=list)  # the thinking's chunks so far
    thinking: Thinking = field(default_factory=lambda: Thinking())
    reason: FinishReason | None = None
    finished: Finished | None = None  # the engine's end of it, when the engine finished it
    error: str = ""  # why it ended, when the engine did not finish it
    error_kind: str = ""  # the engine's Error.kind (context_length_exceeded …)
    message: StoredMessage | None = None  # as stored; None when nothing was kept

    @property
    def text(self) -> str:
        """The whole reply when the engine finished it, else what streamed."""
        return self.finished.text if self.finished is not None else "".join(self.streamed)

    @property
    def reasoning(self) -> str:
        return self.finished.reasoning if self.finished is not None else "".join(self.thought)


class ChatSession(QObject):
    sig_conversation_changed = Signal(int)
    """The open conversation changed or gained messages (its id)."""
    sig_reply_ended = Signal(object)
    """A reply ended, was stored and shown (a `Reply`, its `reason` set): once per reply."""
    sig_opened = Signal(object)
    """Another conversation is shown (its id; None: none)."""

    def __init__(
        self,
        store: ConversationStore,
        client: EngineClient,
        view: ChatView,
        settings: Callable[[], AppSettings],
    ):
        super().__init__(view)
        self.store, self.client, self.view, self._settings = store, client, view, settings
        self.conversation_id: int | None = None
        self.reply: Reply | None = None  # the reply in flight
        self.model_thinks = False  # the loaded model thinks in a <think> block: the Think toggle applies
        self._think_next = True  # thinking on or off for a chat not created yet
        client.sig_reply.connect(self._on_reply_event)
        view.sig_think.connect(self.set_think)
        view.sig_send.connect(self.send)
        view.sig_stop.connect(self.stop)
        view.sig_regenerate.connect(self.regenerate)
        view.sig_edit_resend.connect(self.edit_resend)

    @property
    def busy(self) -> bool:
        return self.reply is not None

    def conversation(self) -> Conversation | None:
        return self.store.get(self.conversation_id) if self.conversation_id is not None else None

    def open(self, conversation_id: int) -> None:
        self._cancel_reply(FinishReason.ABANDONED, "Stopped: another conversation was opened.")
        self.conversation_id = conversation_id
        self.view.set_conversation(self.store.get(conversation_id))
        self.show_think()
        self.sig_opened.emit(conversation_id)

    def set_model_thinks(self, thinks: bool) -> None:
        self.model_thinks = thinks
        self.show_think()

    def set_think(self, on: bool) -> None:
        """Thinking on or off for the open chat (kept in its settings) or the next one."""
        conversation = self.conversation()
        if conversation is None:
            self._think_next = on
        else:
            self.store.set_settings(conversation.id, {**conversation.settings, "think": on})

    def show_think(self) -> None:
        conversation = self.conversation()
        on = conversation.settings.get("think", True) if conversation else self._think_next
        self.view.set_thinking(self.model_thinks, on)

    def close_conversation(self) -> None:
        """Show no conversation (the open one was deleted); a reply in flight is stopped, not kept."""
        self._cancel_reply(FinishReason.DISCARDED, "The conversation was deleted.")
        self.conversation_id = None
        self.view.set_conversation(None)
        self.sig_opened.emit(None)

    def abandon_reply(self, why: str) -> None:
        """End the reply in flight now, its worker going away (a restart, the app closing)."""
        if self.reply is not None:
            self._end(FinishReason.ABANDONED, why)

    # -- user actions ------------------------------------------------------------------------------

    def send(self, text: str) -> None:
        if self.busy or not text.strip():
            return
        if self.conversation_id is None:
            self.conversation_id = self.store.create().id
            if not self._think_next:
                self.store.set_settings(self.conversation_id, {"think": False})
        self.store.add_message(self.conversation_id, "user", text)
        self._refresh()
        self._generate()

    def stop(self) -> None:
        """Ask the engine to stop the reply; it ends when the engine's `Finished` (cancelled) comes."""
        if self.reply is not None:
            self.client.cancel(self.reply.request_id)

    def regenerate(self) -> None:
        conversation = self.conversation()
        if self.busy or conversation is None or not conversation.messages:
            return
        last = conversation.messages[-1]
        if last.role == "assistant" and not is_interrupted(last):
            self.store.delete_messages_from(conversation.id, last.id)
        self._refresh()  # the view shows the store: a failed reply's bubble is its stored entry, or gone
        self._generate()

    def context_use(self) -> int | None:
        """Tokens the open chat's latest reply ended with (its prompt and itself): what the next
        turn starts from; None before a reply."""
        conversation = self.conversation()
        for message in reversed(conversation.messages if conversation else ()):
            if message.role == "assistant" and "prompt_tokens" in (message.stats or {}):
                return message.stats["prompt_tokens"] + message.stats.get("generated_tokens", 0)
        return None

    def droppable_turns(self) -> int:
        """How many of the conversation's turns sent to the model come before its last one: what
        `drop_oldest_turns` could leave out (0: the last message alone fills the context)."""
        conversation = self.conversation()
        if conversation is None:
            return 0
        start = conversation.settings.get("context_from", 0)
        return max(0, sum(m.role == "user" and m.id >= start for m in conversation.messages) - 1)

    def drop_oldest_turns(self) -> None:
        """Leave the older half of the conversation's turns out of what the model is sent (they stay
        stored and shown), then answer the last message again: what a full context window offers."""
        conversation = self.conversation()
        if self.busy or conversation is None:
            return
        start = conversation.settings.get("context_from", 0)
        turns = [m.id for m in conversation.messages if m.role == "user" and m.id >= start]
        if len(turns) < 2:
            return  # the last message alone is too long: nothing older to drop
        keep_from = turns[len(turns) // 2]
        self.store.set_settings(conversation.id, {**conversation.settings, "context_from": keep_from})
        self.regenerate()

    def edit_resend(self, message_id: int, text: str) -> None:
        if self.busy or self.conversation_id is None or not text.strip():
            return
        self.store.delete_messages_from(self.conversation_id, message_id)
        self.store.add_message(self.conversation_id, "user", text)
        self._refresh()
        self._generate()

    def _generate(self) -> None:
        conversation = self.conversation()
        messages = [ChatMessage("system", conversation.system_prompt)] if conversation.system_prompt else []
        start = conversation.settings.get("context_from", 0)  # earlier turns dropped from the context
        shown = [m for m in conversation.messages if m.id >= start]
        messages += [ChatMessage(m.role, m.content) for m in context_messages(shown)]
        sampling, max_new_tokens = sampling_from(conversation.settings)
        config = self._settings().generation_config(sampling, max_new_tokens)
        config = replace(config, template_kwargs=template_kwargs_from(conversation.settings))
        self.reply = Reply(self.client.generate(messages, config), conversation.id)
        self.view.begin_reply()
        self.view.set_busy(True)

    def _refresh(self) -> None:
        self.view.set_conversation(self.conversation())
        self.sig_conversation_changed.emit(self.conversation_id)

    # -- the reply's end ---------------------------------------------------------------------------

    def _on_reply_event(self, event: ReplyEvent) -> None:
        reply = self.reply
        if reply is None or event.request_id != reply.request_id:
            return  # the late end of a reply this session already let go of
        match event:
            case ReplyText(text=text, reasoning=reasoning):
                reply.streamed.append(text)
                reply.thought.append(reasoning)
                reply.thinking.saw(event)
                self.view.append_reply_text(text, reasoning, reply.thinking.label())
            case Finished(reason=reason):
                reply.finished = event
                cause = event.stats.get("error") or {}  # a cut stream's cause (engine.remote)
                self._end(FinishReason(reason), cause.get("message", "") if isinstance(cause, dict) else "")
            case Error(message=message, kind=kind):
                reply.error_kind = kind
                self._end(FinishReason.ERROR, message)
            case WorkerCrashed(message=message):
                self._end(FinishReason.CRASHED, message)

    def _cancel_reply(self, reason: FinishReason, why: str) -> None:
        """Stop the reply in flight without waiting for the engine's answer (which is then ignored)."""
        if self.reply is not None:
            self.client.cancel(self.reply.request_id)
            self._end(reason, why)

    def _end(self, reason: FinishReason, error: str = "") -> None:
        """The one way a reply ends: record why, store it, show it, tell the window."""
        reply, self.reply = self.reply, None
        reply.reason, reply.error = reason, error
        reply.message = self._store(reply)
        if reply.finished is not None:
            self.view.end_reply(reply.message)
        else:
            self.view.fail_reply(error)
        self.view.set_busy(False)
        self.sig_reply_ended.emit(reply)

    def _store(self, reply: Reply) -> StoredMessage | None:
        """Keep the reply: whole when the engine finished it, else what streamed and why it stopped
        (a crash even when nothing streamed: the conversation records that it happened)."""
        if reply.finished is not None:
            stats = dict(reply.finished.stats, finish_reason=reply.finished.reason) | reply.thinking.stats()
            if reply.error:  # a cut remote stream: its cause as the bubble's stats line shows it
                stats["error"] = reply.error
        elif (
            reply.text or reply.reason is FinishReason.CRASHED
        ) and reply.reason is not FinishReason.DISCARDED:
            # "interrupted" is what stored conversations and the bubble's stats line know
            stats = {"finish_reason": INTERRUPTED, "error": reply.error}
        else:
            return None
        return self.store.add_message(reply.conversation_id, "assistant", reply.text, stats, reply.reasoning)
