"""The local OpenAI-compatible server (`moe-chat-cli serve`).

No Qt and no torch: requests go to the worker through `engine.worker.client`.
"""
