"""The main window's conversations: opening, creating and retitling them, and a chat's settings.

Mixed into `MainWindow`: it uses the window's conversation store, the `ChatSession` and the
conversation list.
"""

from __future__ import annotations

from app.gui.chat.chat_session import ChatSession
from app.gui.chat.chat_settings import ChatSettingsDialog
from app.gui.chat.conversation_list import ConversationList
from app.storage import ConversationStore, title_from


class Conversations:
    """MainWindow's part that keeps the open conversation and the list in step."""

    store: ConversationStore
    session: ChatSession
    conversations: ConversationList

    def new_conversation(self) -> None:
        self.session.open(self.store.create().id)
        self.conversations.refresh()
        self.conversations.select(self.session.conversation_id)

    def _open_latest_conversation(self) -> None:
        summaries = self.store.list()
        if summaries:
            self.session.open(summaries[0].id)
            self.conversations.select(summaries[0].id)

    def _on_conversation_selected(self, conversation_id: int) -> None:
        if conversation_id != self.session.conversation_id:
            self.session.open(conversation_id)

    def _on_conversation_deleted(self, conversation_id: int) -> None:
        if conversation_id == self.session.conversation_id:
            self.session.close_conversation()

    def _retitle_on_edit(self, message_id: int, text: str) -> None:
        """Editing the first message retitles a chat whose title came from it (a chosen title stays)."""
        conversation = self.session.conversation()
        if conversation is None or self.session.busy or not text.strip():
            return
        first = next((m for m in conversation.messages if m.role == "user"), None)
        if first is not None and first.id == message_id and conversation.title == title_from(first.content):
            self.store.rename(conversation.id, title_from(text))

    def _on_conversation_changed(self, conversation_id: int) -> None:
        self.conversations.refresh()
        self.conversations.select(conversation_id)

    def open_chat_settings(self) -> None:
        conversation = self.session.conversation()
        if conversation is None:
            self.new_conversation()
            conversation = self.session.conversation()
        dialog = ChatSettingsDialog(conversation.system_prompt, conversation.settings, self)
        if dialog.exec():
            system_prompt, settings = dialog.values()
            self.store.set_system_prompt(conversation.id, system_prompt)
            self.store.set_settings(conversation.id, {**conversation.settings, **settings})  # keeps "think"
