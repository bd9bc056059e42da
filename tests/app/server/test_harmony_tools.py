"""gpt-oss's function calls through the server: a tiny gpt_oss model whose forced call is a harmony
message to `functions.get_weather` comes back to the `openai` client as `tool_calls`, whole and
streamed, and the tool's result goes back in as `role: tool`, rendered by the chat template."""

import json

import pytest

from app.session_setup import DEMO_MODEL_ID
from tests.app.server.conftest import LiveServer
from tests.engine.harmony_model import save_harmony_model
from tests.engine.tool_helpers import WEATHER, WEATHER_QUESTION, check_weather_arguments

pytestmark = pytest.mark.slow

FORCED = {"tools": [WEATHER], "tool_choice": "required", "temperature": 0, "max_tokens": 60}


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    server = LiveServer(model_dir=str(save_harmony_model(tmp_path_factory.mktemp("harmony"))))
    yield server
    server.stop()


def test_a_harmony_call_round_trips_through_the_openai_client(harmony):
    client = harmony.client()
    first = client.chat.completions.create(model=DEMO_MODEL_ID, messages=WEATHER_QUESTION, **FORCED)
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert call.function.name == "get_weather"
    check_weather_arguments(json.loads(call.function.arguments))

    messages = [*WEATHER_QUESTION, choice.message.model_dump(exclude_none=True)]
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 °C, sunny"})
    answer = client.chat.completions.create(
        model=DEMO_MODEL_ID, messages=messages, tools=[WEATHER], temperature=0, max_tokens=8
    )
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result went in


def test_a_harmony_call_streams_as_a_tool_calls_delta(harmony):
    client = harmony.client()
    chunks = list(
        client.chat.completions.create(model=DEMO_MODEL_ID, messages=WEATHER_QUESTION, stream=True, **FORCED)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    (call,) = [tc for d in deltas for tc in d.tool_calls or []]
    assert call.index == 0 and call.function.name == "get_weather"
    check_weather_arguments(json.loads(call.function.arguments))
    assert "".join(d.content or "" for d in deltas) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
