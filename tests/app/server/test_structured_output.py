"""The official `openai` client's structured-output example against the server: `parse()` with a
pydantic model sends a strict json_schema, and the reply parses into that model."""

import pytest
from pydantic import BaseModel, Field

from app.session_setup import DEMO_MODEL_ID

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
