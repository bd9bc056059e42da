"""Driving a `RemoteWorker` request by request, as the GUI's reader thread does."""

from __future__ import annotations

import time

from engine.generation_config import GenerationConfig
from engine.remote import RemoteWorker
from engine.worker.protocol import ChatMessage, Error, Event, Finished, Generate, Loaded, Stats

HI = (ChatMessage("user", "Hi"),)


def events_until_end(worker: RemoteWorker, request_id: str, timeout_s: float = 60) -> list[Event]:
    """The events of `request_id` up to its Finished, Error or Loaded (telemetry Stats left out)."""
    deadline = time.monotonic() + timeout_s
    events: list[Event] = []
    while time.monotonic() < deadline:
        event = worker.poll(0.5)
        if event is None or isinstance(event, Stats) or event.request_id != request_id:
            continue
        events.append(event)
        if isinstance(event, Finished | Error | Loaded):
            return events
    raise AssertionError(f"{request_id} did not end within {timeout_s} s: {events}")


def reply(worker: RemoteWorker, request_id: str, config: GenerationConfig = GenerationConfig(), messages=HI):
    worker.send(Generate(request_id, tuple(messages), config))
    return events_until_end(worker, request_id)
