"""The open conversation and its reply in flight, between the store, the engine client and the view.

Order of writes keeps the user's words safe: the user's message is stored
before it is sent; a reply is stored when it finishes, is stopped, fails, or
the engine dies mid-reply (with what had streamed so far and why it ended).
Regenerate and edit-and-resend delete the stored tail first, then send again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal

from app.gui.chat_settings import sampling_from
from app.gui.chat_view import ChatView
from app.gui.engine_client import EngineClient
from app.settings import AppSettings
from app.storage import Conversation, ConversationStore
from engine.worker.protocol import ChatMessage, Finished

log = logging.getLogger(__name__)


class ChatSession(QObject):
    sig_conversation_changed = Signal(int)
    """The open conversation changed or gained messages (its id)."""

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
        self.request_id: str | None = None
        self._partial: list[str] = []
        view.sig_send.connect(self.send)
        view.sig_stop.connect(self.stop)
        view.sig_regenerate.connect(self.regenerate)
        view.sig_edit_resend.connect(self.edit_resend)

    @property
    def busy(self) -> bool:
        return self.request_id is not None

    def conversation(self) -> Conversation | None:
        return self.store.get(self.conversation_id) if self.conversation_id is not None else None

    def open(self, conversation_id: int) -> None:
        if self.busy:
            self.client.cancel(self.request_id)
            self.abandon_reply("Stopped: another conversation was opened.")
        self.conversation_id = conversation_id
        self.view.set_conversation(self.store.get(conversation_id))

    def close_conversation(self) -> None:
        """Show no conversation (the open one was deleted); a reply in flight is stopped."""
        if self.busy:
            self.client.cancel(self.request_id)
            self.request_id = None
            self.view.set_busy(False)
        self.conversation_id = None
        self.view.set_conversation(None)

    # -- user actions ------------------------------------------------------------------------------

    def send(self, text: str) -> None:
        if self.busy or not text.strip():
            return
        if self.conversation_id is None:
            self.conversation_id = self.store.create().id
        self.store.add_message(self.conversation_id, "user", text)
        self._refresh()
        self._generate()

    def stop(self) -> None:
        if self.busy:
            self.client.cancel(self.request_id)

    def regenerate(self) -> None:
        conversation = self.conversation()
        if self.busy or conversation is None or not conversation.messages:
            return
        last = conversation.messages[-1]
        if last.role == "assistant":
            self.store.delete_messages_from(conversation.id, last.id)
            self._refresh()
        self._generate()

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
        messages += [ChatMessage(m.role, m.content) for m in conversation.messages]
        sampling, max_new_tokens = sampling_from(conversation.settings)
        config = self._settings().generation_config(sampling, max_new_tokens)
        self._partial = []
        self.request_id = self.client.generate(messages, config)
        self.view.begin_reply()
        self.view.set_busy(True)

    def _refresh(self) -> None:
        self.view.set_conversation(self.conversation())
        self.sig_conversation_changed.emit(self.conversation_id)

    # -- engine events -----------------------------------------------------------------------------

    def on_tokens(self, request_id: str, text: str, count: int) -> None:
        if request_id == self.request_id:
            self._partial.append(text)
            self.view.append_reply_text(text)

    def on_finished(self, request_id: str, finished: Finished) -> None:
        if request_id != self.request_id:
            return
        stats = dict(finished.stats, finish_reason=finished.reason)
        message = self.store.add_message(self.conversation_id, "assistant", finished.text, stats)
        self.request_id = None
        self.view.end_reply(message)
        self.view.set_busy(False)

    def on_error(self, request_id: str, kind: str, message: str) -> bool:
        """Handle an error of the reply in flight; False when the error is not about it."""
        if request_id != self.request_id:
            return False
        self.abandon_reply(message)
        return True

    def abandon_reply(self, reason: str) -> None:
        """End the reply in flight without its Finished: keep what streamed, say why it ended."""
        if not self.busy:
            return
        text = "".join(self._partial)
        if text:
            stats = {"finish_reason": "interrupted", "error": reason}
            self.store.add_message(self.conversation_id, "assistant", text, stats)
        self.request_id = None
        self.view.fail_reply(reason)
        self.view.set_busy(False)
