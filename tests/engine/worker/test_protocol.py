"""The worker protocol: every message survives the wire; anything malformed is refused by name."""

import json
import subprocess
import sys

import pytest

from engine.config import ExpertBudget, OffloadConfig
from engine.generation_config import CompletionPrompt, GenerationConfig, SamplingConfig, SpecConfig
from engine.worker.protocol import (
    MESSAGES,
    PROTOCOL_VERSION,
    Cancel,
    ChatMessage,
    DeviceInfo,
    Error,
    Finished,
    Generate,
    GetStats,
    Loaded,
    LoadModel,
    LoadProgress,
    Notice,
    PromptEcho,
    ProtocolError,
    ProtocolVersionError,
    Ready,
    Shutdown,
    Stats,
    Token,
    TokenLogprob,
    Tune,
    TuneProgress,
    TuneResult,
    decode,
    dumps,
    encode,
    loads,
)

STATS = Stats(
    request_id="r7",
    time_s=12.5,
    generating=True,
    simulated_link=True,
    vram_used_bytes=None,
    vram_total_bytes=None,
    torch_allocated_bytes=None,
    torch_reserved_bytes=None,
    host_ram_used_bytes=3 << 30,
    host_ram_total_bytes=16 << 30,
    process_rss_bytes=1 << 29,
    h2d_bytes=123456,
    h2d_gbps=0.25,
    pcie_rx_gbps=None,
    pcie_tx_gbps=None,
    hits=10,
    misses=4,
    hit_rate=0.5,
    hit_rate_total=10 / 14,
    hit_rate_by_phase={"decode": 0.75, "prefill": None},
    generated_tokens=9,
    tokens_per_s=31.5,
    tpot_ms=31.7,
    accept_len=2.5,
    prefetch_precision=0.9,
    prefetch_recall=None,
    cutoff_layer=3,
    cache_slots_used=20,
    cache_slots_total=24,
    extra={"note": [1, 2]},
)

EXAMPLES = [
    LoadModel("r1"),
    LoadModel(
        "r2",
        "/models/qwen",
        OffloadConfig(device="cpu", expert_budget=ExpertBudget(nbytes=2 << 30), sim_link_gbps=8.0),
    ),
    Generate(
        "r3",
        (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi — ünïcode ✓")),
        GenerationConfig(
            max_new_tokens=7,
            sampling=SamplingConfig(
                temperature=0.5, top_k=3, seed=11, presence_penalty=0.5, logit_bias=((7, -100.0), (9, 2.5))
            ),
            stop_strings=("\n\n", "END"),
            spec=SpecConfig(mode="self", top_r=1, draft_len=3),
            prefetch="spmoe",
            cutoff=2,
        ),
    ),
    Generate(
        "r7", (), GenerationConfig(logprobs=2), CompletionPrompt("def f(", suffix="\n    return x", echo=True)
    ),
    Generate("r9", (), GenerationConfig(), CompletionPrompt(token_ids=(5, 6, 7))),
    Cancel("r4", "r3"),
    GetStats("r5"),
    Tune("r8", "/models/draft", 16, True),
    Shutdown("r6"),
    Ready("", PROTOCOL_VERSION, 4242, DeviceInfo("cpu", "x86_64", None, "2.13.0")),
    LoadProgress("r1", "experts", 5, 96),
    Loaded("r1", {"model_type": "qwen3_moe", "cache_slots": 24, "simulated_link": True}, 1.5),
    Notice("r1", "Retrying with 12 experts."),
    Token("r3", "moo", 1234, 3, 12.5),
    Token("r3", " moo", 17, 4, 3.0, "", (TokenLogprob(" moo", -0.25, ((" moo", -0.25), (" baa", -1.5))),)),
    Token(
        "r7",
        "x",
        9,
        0,
        1.0,
        "",
        (),
        PromptEcho("def f(", ("def", " f("), (None, TokenLogprob(" f(", -3.5, ((" f(", -3.5),)))),
    ),
    Finished("r3", "eos", "A cow says moo.", "", 20, 6, {"tpot_ms": 5.0, "accept_len": None}),
    STATS,
    TuneProgress("r8", "verify", 3, 16),
    TuneResult("r8", {"choice": {"cutoff_layer": 2, "draft_len": 4}, "measured": [], "reused": False}),
    Error("r3", "invalid_request", "temperature must be >= 0"),
]


def test_the_examples_cover_every_message_type():
    assert {type(m).__name__ for m in EXAMPLES} == set(MESSAGES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_the_wire(message):
    assert loads(dumps(message)) == message
    wire = encode(message)
    assert wire["v"] == PROTOCOL_VERSION and wire["type"] == type(message).__name__
    assert decode(json.loads(json.dumps(wire))) == message  # plain JSON builtins only


def test_requests_and_events_are_told_apart():
    assert decode(encode(GetStats("a")), expect="request") == GetStats("a")
    with pytest.raises(ProtocolError, match="not a request"):
        decode(encode(Notice("a", "x")), expect="request")
    with pytest.raises(ProtocolError, match="not a event"):
        decode(encode(GetStats("a")), expect="event")


def test_another_protocol_version_is_refused_by_name():
    wire = encode(GetStats("a")) | {"v": PROTOCOL_VERSION + 1}
    with pytest.raises(ProtocolVersionError, match=r"version mismatch.*Reinstall"):
        decode(wire)
    with pytest.raises(ProtocolVersionError):
        decode({k: v for k, v in wire.items() if k != "v"})


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (["not", "a", "dict"], "must be a dict"),
        ({"v": PROTOCOL_VERSION, "type": "Explode", "request_id": "a"}, "Unknown message type 'Explode'"),
        ({"v": PROTOCOL_VERSION, "type": "Cancel", "request_id": "a"}, "missing field.*target_id"),
        ({"v": PROTOCOL_VERSION, "type": "GetStats", "request_id": "a", "x": 1}, "unknown field.*x"),
        ({"v": PROTOCOL_VERSION, "type": "GetStats", "request_id": 5}, "request_id: expected str"),
        (
            {"v": PROTOCOL_VERSION, "type": "Token", "request_id": "a", "text": "", "token_id": True}
            | {"index": 0, "elapsed_ms": 1.0},
            "token_id: expected a number, got a boolean",
        ),
        (
            encode(Generate("g", (ChatMessage("user", "x"),)))
            | {"config": {"sampling": {"temperature": "hot"}}},
            r"config\.sampling\.temperature",
        ),
        (encode(Generate("g", ())) | {"messages": [{"role": "user"}]}, "missing field.*content"),
        (encode(Generate("g", ())) | {"messages": "hello"}, "expected a list"),
        (
            encode(Generate("g", ())) | {"config": {"sampling": {"logit_bias": [[7, -100.0, 3]]}}},
            r"logit_bias\[0\]: expected 2 items",
        ),
    ],
)
def test_malformed_messages_are_refused_with_the_reason(wire, message):
    with pytest.raises(ProtocolError, match=message):
        decode(wire)


def test_bytes_that_are_not_json_are_a_protocol_error():
    with pytest.raises(ProtocolError, match="not valid JSON"):
        loads(b"\x80\x81 not json")


def test_the_protocol_and_the_client_do_not_import_torch():
    code = "import sys, engine.worker.protocol, engine.worker.client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
