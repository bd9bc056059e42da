"""The official `openai` client's structured-output example against the server: `parse()` with a
pydantic model sends a strict json_schema, and the reply parses into that model."""

import json

import pytest
from pydantic import BaseModel, Field

from app.session_setup import DEMO_MODEL_ID
from tests.engine.tool_helpers import CLOCK, WEATHER, WEATHER_QUESTION, check_weather_arguments

pytestmark = pytest.mark.slow


class Farmer(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    likes_cows: bool


ASK = [{"role": "user", "content": "Describe a farmer."}]


def test_parse_gives_the_pydantic_model(live):
    client = live.client()
    reply = client.chat.completions.parse(
        model=DEMO_MODEL_ID, messages=ASK, response_format=Farmer, temperature=0, max_tokens=60
    )
    farmer = reply.choices[0].message.parsed
    assert isinstance(farmer, Farmer) and reply.choices[0].finish_reason == "stop"
    assert reply.stats["drafter"] == "none"  # constrained replies decode plainly


def test_json_object_streams_an_object(live):
    client = live.client()
    chunks = client.chat.completions.create(
        model=DEMO_MODEL_ID,
        messages=ASK,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=8,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith('{"')


def test_a_bad_schema_is_a_400(live):
    status, body = live.request(
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema",'
        b' "json_schema": {"name": "x"}}}',
    )
    assert status == 400 and body["error"]["param"].startswith("response_format")


def test_a_named_tool_choice_makes_the_demo_model_call_it(live):
    client = live.client()
    reply = client.chat.completions.create(
        model=DEMO_MODEL_ID,
        messages=WEATHER_QUESTION,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=80,
    )
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "get_weather"
    check_weather_arguments(json.loads(call.function.arguments))
    assert reply.stats["drafter"] == "none"  # a forced call decodes plainly


def test_a_required_tool_choice_streams_one_call(live):
    client = live.client()
    chunks = list(
        client.chat.completions.create(
            model=DEMO_MODEL_ID,
            messages=WEATHER_QUESTION,
            tools=[CLOCK],
            tool_choice="required",
            temperature=0,
            max_tokens=80,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    (call,) = [tc for d in deltas for tc in d.tool_calls or []]
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
    assert "".join(d.content or "" for d in deltas) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tool_choice": "required"}, "no tools"),
        ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": [CLOCK], "tool_choice": "always"}, "tool_choice must be"),
        ({"tools": [CLOCK], "tool_choice": "required", "response_format": {"type": "json_object"}}, "both"),
    ],
)
def test_a_tool_choice_that_cannot_be_met_is_a_400(live, extra, message):
    body = json.dumps({"messages": WEATHER_QUESTION, **extra}).encode()
    status, answer = live.request("POST", "/v1/chat/completions", body)
    assert status == 400 and message in answer["error"]["message"], answer


class Trip(BaseModel):
    destination: str
    days: int
    items: list[str]


# prompts these tests were not written around: the demo model babbles, the reply must close anyway
UNSEEN = ("Which country is Rome in?", "List three fruits you like.", "What should I pack for a beach trip?")


@pytest.mark.parametrize("prompt", UNSEEN)
def test_constrained_replies_close_valid_within_their_token_limit(live, prompt):
    """`parse()`, `json_object` and a required tool call, sampled, with limits too short for what
    the demo model would write: each reply closes what is open in time, so it ends with `stop`
    (or `tool_calls`) and is valid; the call streams as tool-call deltas."""
    client = live.client()
    messages = [{"role": "user", "content": prompt}]
    sampled = {"temperature": 0.9, "seed": 11}
    trip = client.chat.completions.parse(
        model=DEMO_MODEL_ID, messages=messages, response_format=Trip, max_tokens=48, **sampled
    )
    assert trip.choices[0].finish_reason == "stop" and isinstance(trip.choices[0].message.parsed, Trip)
    obj = client.chat.completions.create(
        model=DEMO_MODEL_ID,
        messages=messages,
        response_format={"type": "json_object"},
        max_tokens=40,
        **sampled,
    )
    assert obj.choices[0].finish_reason == "stop" and isinstance(
        json.loads(obj.choices[0].message.content), dict
    )
    chunks = list(
        client.chat.completions.create(
            model=DEMO_MODEL_ID,
            messages=messages,
            tools=[WEATHER, CLOCK],
            tool_choice="required",
            max_tokens=48,
            stream=True,
            **sampled,
        )
    )
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"] and len(deltas) == 1
    assert deltas[0].function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(deltas[0].function.arguments), dict)
