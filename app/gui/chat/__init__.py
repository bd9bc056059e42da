"""The chat screen: the conversation pane, the reply in flight, the sidebar and per-chat settings.

- `chat_view`: `ChatView`, one conversation's bubbles, the streaming reply and the input box;
- `chat_bubbles`: the reply and user bubbles, their labels and the input box;
- `thinking`: a reply's thinking, timed and counted, and the collapsed panel that shows it;
- `chat_session`: `ChatSession`, the open conversation and its reply from request to end,
  between the store, the engine client and the view;
- `chat_settings`: a conversation's system prompt and generation settings (dialog and conversion);
- `conversation_list`: `ConversationList`, the sidebar of saved conversations.

May import: PySide6, the Qt-free modules of `app`, the engine's torch-free modules, and the
`widgets` and `engine` rooms. Never another screen, `window` or `startup`.
"""
