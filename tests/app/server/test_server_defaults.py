"""The server with no options speculates and prefetches, and its JSON stats name what ran."""

import pytest

from app.server.openai_api import ChatBackend
from app.server.openai_server import build_parser
from app.session_setup import DEMO_MODEL_ID
from engine.config import OffloadConfig
from engine.options import generation_config
from engine.worker.client import EngineSession

COW = [{"role": "user", "content": "What sound does a cow make?"}]


def test_the_servers_defaults_are_auto():
    config = generation_config(build_parser().parse_args([]))
    assert (config.spec.mode, config.prefetch, config.cutoff) == ("auto", "auto", None)


@pytest.mark.slow
def test_stats_name_the_drafter_and_the_prefetch_policy():
    defaults = generation_config(build_parser().parse_args(["--max-new-tokens", "24"]))
    session = EngineSession()
    session.start()
    try:
        session.load(offload=OffloadConfig(device="cpu"))
        backend = ChatBackend(session, DEMO_MODEL_ID, defaults)
        try:
            reply = backend.complete({"model": DEMO_MODEL_ID, "messages": COW, "temperature": 0})
            chunks = list(backend.stream({"model": DEMO_MODEL_ID, "messages": COW, "stream": True}))
        finally:
            backend.close()
    finally:
        session.close()
    stats = reply["stats"]
    assert stats["drafter"] == "draft"  # the demo's bundled draft model
    assert stats["prefetch"].startswith("spmoe")
    assert stats["accept_len"] is not None and stats["accept_len"] >= 1
    last = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert last["stats"]["drafter"] == "draft" and last["stats"]["prefetch"].startswith("spmoe")
