"""The terminal chat (`moe-chat-cli`); `moe-chat-cli serve` hands over to `app.server`.

No Qt and no torch: it drives the worker through `engine.worker.client`.
"""
