"""OpenAI's Responses API (`POST /v1/responses`) over the demo model behind a real server, through
the official `openai` client: the whole path, greedy replies compared with the chat completions
they translate to (text, streaming, the token limit, instructions, a forced function call, a call
and its output in the input, a text format, bad requests)."""

import json

import pytest
from openai.types.responses import ResponseFunctionToolCall
from pydantic import BaseModel, Field

from app.session_setup import DEMO_MODEL_ID
from tests.app.server.conftest import COW, assert_openai_error
from tests.app.server.test_responses_api import WEATHER_TOOL, function_call
from tests.engine.tool_helpers import WEATHER, check_weather_arguments


@pytest.mark.slow
def test_a_response_has_the_text_and_usage_of_the_chat_completion(live_client):
    response = live_client.responses.create(model=DEMO_MODEL_ID, input=COW[0]["content"], temperature=0)
    reply = live_client.chat.completions.create(model=DEMO_MODEL_ID, messages=COW, temperature=0)
    assert response.output_text and response.output_text == reply.choices[0].message.content
    assert response.status == "completed" and response.model == DEMO_MODEL_ID
    usage, chat_usage = response.usage, reply.usage
    assert (usage.input_tokens, usage.output_tokens) == (
        chat_usage.prompt_tokens,
        chat_usage.completion_tokens,
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens > 0
    assert response.stats["drafter"] is not None


@pytest.mark.slow
def test_streamed_deltas_make_the_final_text(live_client):
    events = list(live_client.responses.create(model=DEMO_MODEL_ID, input=COW, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == final.output_text == events[-4].text
    assert final.usage.output_tokens > 0 and final.id == events[0].response.id


@pytest.mark.slow
def test_a_token_limit_makes_an_incomplete_response(live_client):
    response = live_client.responses.create(
        model=DEMO_MODEL_ID, input=COW, temperature=0, max_output_tokens=2
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.max_output_tokens == 2


@pytest.mark.slow
def test_instructions_are_a_system_message_first(live_client):
    instructions = "You are a farmer. Answer in one word."
    response = live_client.responses.create(
        model=DEMO_MODEL_ID, instructions=instructions, input=COW, temperature=0
    )
    messages = [{"role": "system", "content": instructions}, *COW]
    reply = live_client.chat.completions.create(model=DEMO_MODEL_ID, messages=messages, temperature=0)
    assert response.output_text == reply.choices[0].message.content
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    plain = live_client.responses.create(model=DEMO_MODEL_ID, input=COW, temperature=0, max_output_tokens=1)
    assert response.usage.input_tokens > plain.usage.input_tokens  # the instructions were read
    assert response.instructions == instructions


@pytest.mark.slow
def test_a_named_tool_choice_makes_a_function_call_item(live_client):
    forced = {
        "model": DEMO_MODEL_ID,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0,
        "max_output_tokens": 80,
    }
    response = live_client.responses.create(**forced)
    (call,) = response.output
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    assert call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    check_weather_arguments(json.loads(call.arguments))
    events = list(live_client.responses.create(**forced, stream=True))
    assert [e.type for e in events][2:-1] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert events[2].item.arguments == "" and events[-2].item.arguments == call.arguments


@pytest.mark.slow
def test_a_call_and_its_output_in_the_input_are_the_chat_conversation(live_client):
    call, chat_call = function_call("call_1", "Paris")
    output = {"type": "function_call_output", "call_id": "call_1", "output": "18 °C, sunny"}
    question = {"role": "user", "content": "What is the weather in Paris?"}
    response = live_client.responses.create(
        model=DEMO_MODEL_ID, input=[question, call, output], tools=[WEATHER_TOOL], temperature=0
    )
    messages = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 °C, sunny"},
    ]
    reply = live_client.chat.completions.create(
        model=DEMO_MODEL_ID, messages=messages, tools=[WEATHER], temperature=0
    )
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    assert response.output_text == (reply.choices[0].message.content or "")
    calls = [item.name for item in response.output if item.type == "function_call"]
    assert calls == [c.function.name for c in reply.choices[0].message.tool_calls or ()]


class Farmer(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)


@pytest.mark.slow
def test_a_text_format_gives_the_parsed_model(live_client):
    response = live_client.responses.parse(
        model=DEMO_MODEL_ID,
        input="Describe a farmer.",
        text_format=Farmer,
        temperature=0,
        max_output_tokens=60,
    )
    assert isinstance(response.output_parsed, Farmer) and response.status == "completed"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": 5}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),  # found by the chat backend: no tools to call
        ({"input": "moo " * 3000}, "input"),  # past the context window: chat's `messages`
        ({"input": "moo " * 3000, "stream": True}, "input"),
    ],
)
def test_a_bad_request_over_http_is_a_400_naming_its_parameter(live, fields, param):
    status, body = live.request("POST", "/v1/responses", json.dumps({"input": "Hi", **fields}).encode())
    assert status == 400 and assert_openai_error(body)["param"] == param, body
