"""The terminal chat (`moe-chat-cli`); `moe-chat-cli serve` hands over to `app.server`.

`chat` is the conversation loop and its commands; `console` how messages are read and replies shown.

No Qt and no torch: it drives the worker through `engine.worker.client`.
"""
