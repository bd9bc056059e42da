"""Structured output: with a response_format the reply parses as JSON and validates against the
schema, greedy and sampled, on the demo model (which was never trained to write JSON)."""

import dataclasses
import json

import pytest

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import InvalidRequestError
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.loader import load_model
from engine.resources import demo_model_dir
from tests.engine.tool_helpers import CLOCK, WEATHER, WEATHER_QUESTION, check_weather_arguments

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "likes_cows": {"type": "boolean"},
    },
    "required": ["name", "age", "likes_cows"],
    "additionalProperties": False,
}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
ASK = [{"role": "user", "content": "Describe a farmer as JSON."}]


@pytest.fixture(scope="module")
def demo():
    model = load_model(demo_model_dir(), OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=24)))
    yield model
    model.close()


def _config(response_format, **sampling) -> GenerationConfig:
    sampling = SamplingConfig(**sampling) if sampling else SamplingConfig(greedy=True)
    return GenerationConfig(max_new_tokens=80, sampling=sampling, response_format=response_format)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "sampled"])
def test_a_json_schema_reply_validates(demo, sampling):
    reply = generate_text(demo, ASK, _config(SCHEMA, **sampling))
    person = json.loads(reply.text)
    assert reply.reason == "eos" and set(person) == {"name", "age", "likes_cows"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
    assert isinstance(person["likes_cows"], bool)


def test_a_json_object_reply_is_an_object_where_free_text_is_not(demo):
    free = generate_text(demo, ASK, _config(None))
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)
    reply = generate_text(demo, ASK, _config({"type": "json_object"}))
    # the demo model babbles inside a string, closed as the token limit nears: an object all the same
    assert reply.text.startswith('{"') and not free.text.startswith("{")
    assert reply.reason == "eos" and isinstance(json.loads(reply.text), dict)


@pytest.mark.parametrize("seed", range(4))
def test_a_reply_closes_what_is_open_before_its_token_limit(demo, seed):
    """Sampled, with a limit the demo model's babbling would overrun: the open string is closed
    (values yet to write are empty), every required key written, and the reply ends with the
    end-of-turn token inside the limit; a forced call likewise ends with its closing tag (given the
    ~45 tokens the shortest call takes in the demo's small vocabulary)."""
    sampling = SamplingConfig(temperature=1.0, seed=seed)
    trip = {
        "type": "object",
        "properties": {"to": {"type": "string"}, "days": {"type": "integer"}, "pack": {"type": "array"}},
        "required": ["to", "days", "pack"],
    }
    schema = {"type": "json_schema", "json_schema": {"name": "trip", "schema": trip}}
    config = GenerationConfig(max_new_tokens=40, sampling=sampling, response_format=schema)
    reply = generate_text(demo, [{"role": "user", "content": "Plan a trip to the sea."}], config)
    assert reply.reason == "eos" and len(reply.token_ids) <= 40
    assert set(json.loads(reply.text)) == {"to", "days", "pack"}
    call = dataclasses.replace(
        config, max_new_tokens=60, response_format=None, tools=(WEATHER, CLOCK), tool_choice="required"
    )
    reply = generate_text(demo, WEATHER_QUESTION, call)
    assert reply.reason == "eos" and _call(reply.text)["name"] in ("get_weather", "get_time")


@pytest.mark.parametrize(
    "response_format",
    [{"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": "no"}}],
)
def test_a_malformed_response_format_is_refused(response_format):
    with pytest.raises(InvalidRequestError, match="response_format"):
        _config(response_format).validate()


def test_speculation_with_a_response_format_is_refused_not_changed(demo):
    config = GenerationConfig(response_format={"type": "json_object"}, spec=SpecConfig(mode="self"))
    with pytest.raises(InvalidRequestError, match="decodes plainly"):
        generate_text(demo, ASK, config)


def _call(text: str) -> dict:
    """The one `<tool_call>` block a forced reply is."""
    opening, closing = "<tool_call>\n", "\n</tool_call>"
    assert text.startswith(opening) and text.endswith(closing), text
    return json.loads(text[len(opening) : -len(closing)])


@pytest.mark.parametrize(
    ("tool_choice", "name"),
    [
        ("required", None),
        ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
        ({"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
    ],
)
def test_a_forced_tool_choice_is_one_valid_call(demo, tool_choice, name):
    config = GenerationConfig(
        max_new_tokens=80,
        sampling=SamplingConfig(greedy=True),
        tools=(WEATHER, CLOCK),
        tool_choice=tool_choice,
    )
    reply = generate_text(demo, WEATHER_QUESTION, config)
    call = _call(reply.text)
    assert reply.reason == "eos" and set(call) == {"name", "arguments"}
    assert call["name"] == name or (name is None and call["name"] in ("get_weather", "get_time"))
    if call["name"] == "get_time":
        assert call["arguments"] == {}
    else:
        check_weather_arguments(call["arguments"])


def test_without_a_forced_choice_the_demo_model_calls_nothing(demo):
    config = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(greedy=True), tools=(WEATHER,))
    assert "<tool_call>" not in generate_text(demo, WEATHER_QUESTION, config).text


@pytest.mark.parametrize(
    ("tools", "tool_choice", "message"),
    [
        ((WEATHER,), {"type": "function", "function": {"name": "get_time"}}, "not a tool"),
        ((), "required", "needs tools"),
        ((WEATHER,), "always", "tool_choice must be"),
        ((WEATHER,), {"function": {"name": "get_weather"}}, "tool_choice must be"),
    ],
)
def test_a_tool_choice_that_cannot_be_met_is_refused(tools, tool_choice, message):
    with pytest.raises(InvalidRequestError, match=message):
        GenerationConfig(tools=tools, tool_choice=tool_choice).validate()


def test_a_forced_call_and_a_response_format_together_are_refused():
    config = GenerationConfig(
        tools=(WEATHER,), tool_choice="required", response_format={"type": "json_object"}
    )
    with pytest.raises(InvalidRequestError, match="both"):
        config.validate()
