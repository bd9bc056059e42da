"""The terminal chat (`moe-chat-cli`) and the session set-up it shares with the server.

No Qt and no torch: it drives the worker through `engine.worker.client`.
"""
