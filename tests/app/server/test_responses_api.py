"""OpenAI's Responses API (`POST /v1/responses`) over the chat backend: a request becomes the chat
body asking for the same reply, the reply becomes a `response` object or its events, and the
official `openai` client reads both as its own types.

The translation is checked without a server; a scripted backend behind a real server gives a reply
with reasoning, text and a call (and errors where wanted). The demo model behind a real server is
tests/app/server/test_responses_demo.py."""

import json

import openai
import pydantic
import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
    ResponseStreamEvent,
)

from app.server.openai_server import ApiServer
from app.server.replies import chunk, envelope
from app.server.responses_api import chat_body, parse_request, responses_param
from app.server.responses_items import ResponseStream, whole_response
from app.server.schemas import ApiError
from app.session_setup import DEMO_MODEL_ID
from tests.engine.tool_helpers import WEATHER

WEATHER_TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat function tool
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def function_call(call_id: str, city: str) -> tuple[dict, dict]:
    """A call of get_weather as a Responses input item, and as chat's tool call."""
    arguments = json.dumps({"city": city})
    item = {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": arguments}
    function = {"name": "get_weather", "arguments": arguments}
    return item, {"id": call_id, "type": "function", "function": function}


def parts(kind: str, *texts: str) -> list[dict]:
    return [{"type": kind, "text": text} for text in texts]


CALL = function_call("call_1", "Oslo")[1]


def request(**fields) -> dict:
    return chat_body(parse_request({"input": "Hi", **fields}))


def test_a_conversation_becomes_the_chat_body_asking_for_the_same_reply():
    (oslo, oslo_call), (bergen, bergen_call) = (
        function_call("call_1", "Oslo"),
        function_call("call_2", "Bergen"),
    )
    schema = {"type": "json_schema", "name": "weather", "schema": {"type": "object"}, "strict": True}
    body = request(
        model=DEMO_MODEL_ID,
        instructions="Be brief.",
        input=[
            {"role": "user", "content": parts("input_text", "Weather in ", "Oslo?")},
            {"type": "reasoning", "id": "rs_1", "summary": []},  # sent back with the output: not read
            {"type": "message", "role": "assistant", "content": parts("output_text", "Let me see.")},
            oslo,
            bergen,
            {"type": "function_call_output", "call_id": "call_1", "output": "4 °C"},
            {"type": "function_call_output", "call_id": "call_2", "output": parts("input_text", "9 °C")},
        ],
        tools=[{**WEATHER_TOOL, "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=20,
        temperature=0.5,
        top_p=0.9,
        text={"format": schema},
        reasoning={"effort": "low"},
        metadata={"ticket": "7"},
        store=True,
        parallel_tool_calls=False,
        user="someone",
        stream=True,
    )
    assert body == {
        "model": DEMO_MODEL_ID,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "Let me see.",
                "tool_calls": [oslo_call, bergen_call],
            },  # one turn
            {"role": "tool", "tool_call_id": "call_1", "content": "4 °C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "9 °C"},
        ],
        "max_tokens": 20,
        "temperature": 0.5,
        "top_p": 0.9,
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": {"type": "object"}, "strict": True},
        },
        "reasoning_effort": "low",
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_a_string_input_is_a_user_message_and_calls_alone_are_an_assistant_turn():
    assert request() == {"messages": [{"role": "user", "content": "Hi"}]}
    call, chat_call = function_call("c", "Rome")
    body = request(input=[call], text={"format": {"type": "json_object"}}, tool_choice="none")
    assert body["messages"] == [{"role": "assistant", "content": None, "tool_calls": [chat_call]}]
    assert body["response_format"] == {"type": "json_object"} and body["tool_choice"] == "none"
    assert "response_format" not in request(text={"format": {"type": "text"}})


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": ["Hi"]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
        ),
        ({"input": [{"role": "user", "content": "x"}, {"type": "web_search_call"}]}, "input[1].type"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": "9"}, "max_output_tokens"),
        ({"background": True}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"metadata": {"n": 1}}, "metadata.n"),
    ],
)
def test_a_bad_request_is_a_400_naming_its_responses_parameter(fields, param):
    with pytest.raises(ApiError) as caught:
        request(**fields)
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message
    if param == "previous_response_id":
        assert "send the whole conversation as input" in caught.value.message


def test_what_asks_for_nothing_unsupported_is_taken():
    harmless = {"background": False, "include": [], "store": False, "truncation": "disabled"}
    assert parse_request({"input": "Hi", **harmless, "previous_response_id": None}).input == "Hi"


def test_a_chat_parameter_in_a_backend_error_becomes_the_responses_one():
    assert responses_param("messages") == responses_param("messages[3].content") == "input"
    assert responses_param("max_tokens") == "max_output_tokens"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("reasoning_effort") == "reasoning.effort"
    assert responses_param("tools[1].function.parameters") == "tools[1].parameters"
    assert responses_param("tool_choice") == "tool_choice" and responses_param(None) is None


def chat_completion(finish: str = "tool_calls", calls: tuple = (CALL,)) -> dict:
    message = {
        "role": "assistant",
        "content": "Moo.",
        "reasoning_content": "A cow.",
        "tool_calls": list(calls),
    }
    usage = {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    return {
        **envelope("chat.completion", DEMO_MODEL_ID),
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage,
        "stats": {"drafter": "none"},
    }


def chat_chunks(finish: str = "tool_calls") -> list[dict]:
    """`chat_completion()` streamed as `ChatBackend.stream` sends it, usage asked for."""
    head = {**envelope("chat.completion.chunk", DEMO_MODEL_ID), "usage": None}
    deltas = [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "A "},
        {"reasoning_content": "cow."},
    ]
    deltas += [{"content": "Mo"}, {"content": "o."}, {"tool_calls": [{"index": 0, **CALL}]}]
    last = {**chunk(head, {}, finish), "stats": {"drafter": "none"}}
    return [
        *(chunk(head, d) for d in deltas),
        last,
        {**head, "choices": [], "usage": chat_completion()["usage"]},
    ]


ECHO = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True}  # what a request adds
ORDER = [
    "response.created",
    "response.in_progress",
    *("response.output_item.added", "response.content_part.added"),
    *("response.reasoning_text.delta",) * 2,
    *("response.reasoning_text.done", "response.content_part.done", "response.output_item.done"),
    *("response.output_item.added", "response.content_part.added"),
    *("response.output_text.delta",) * 2,
    *("response.output_text.done", "response.content_part.done", "response.output_item.done"),
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


def test_a_chat_reply_is_a_response_with_reasoning_message_and_call_items():
    response = Response.model_validate(whole_response(chat_completion(), ECHO))
    reasoning, message, call = response.output
    assert isinstance(reasoning, ResponseReasoningItem) and reasoning.content[0].text == "A cow."
    assert isinstance(message, ResponseOutputMessage) and response.output_text == "Moo."
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
    assert call.call_id == "call_1" and call.id.startswith("fc_") and response.id.startswith("resp_")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (7, 5, 12)
    assert usage.input_tokens_details.cached_tokens == 3 and response.stats == {"drafter": "none"}
    assert response.status == "completed"
    cut = Response.model_validate(whole_response(chat_completion("length", ()), ECHO))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in cut.output] == ["completed", "incomplete"]


def test_chat_chunks_are_responses_events_in_openai_order():
    stream = ResponseStream(ECHO)
    events = list(stream.events(iter(chat_chunks())))
    assert [e["type"] for e in events] == ORDER
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)  # each is the openai client's own type, all fields there
    final = events[-1]["response"]
    assert final["output"] == [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["usage"]["input_tokens"] == 7 and final["stats"] == {"drafter": "none"}
    error = stream.error(ApiError(503, "The engine stopped.", "server_error", code="engine_unavailable"))
    assert error == {
        "type": "error",
        "code": "engine_unavailable",
        "message": "The engine stopped.",
        "param": None,
        "sequence_number": len(events),
    }
    role, _, _, *text, _call, last, usage = chat_chunks("length")  # the text alone, cut
    cut = list(ResponseStream(ECHO).events(iter([role, *text, last, usage])))
    assert cut[-1]["type"] == "response.incomplete" and cut[-2]["item"]["status"] == "incomplete"


class ScriptedChat:
    """Stands in for `ChatBackend`: answers every chat body with `chat_completion()`, streamed as
    `chat_chunks()`; `failure` is raised before the first chunk, or after `fail_after` of them."""

    model_id = DEMO_MODEL_ID

    def __init__(self):
        self.bodies: list[dict] = []
        self.failure: ApiError | None = None
        self.fail_after = 0

    def complete(self, body, cancelled=None) -> dict:
        self.bodies.append(body)
        if self.failure is not None:
            raise self.failure
        return chat_completion()

    def stream(self, body):
        self.bodies.append(body)
        for n, part in enumerate(chat_chunks()):
            if self.failure is not None and n == self.fail_after:
                raise self.failure
            yield part


@pytest.fixture
def scripted():
    chat = ScriptedChat()
    server = ApiServer(chat, port=0).start()
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30) as client:
        yield chat, client
    server.stop()


def test_the_openai_client_reads_a_response_and_its_stream_as_its_types(scripted):
    chat, client = scripted
    response = client.responses.create(
        model=DEMO_MODEL_ID, input="Moo?", tools=[WEATHER_TOOL], metadata={"a": "b"}
    )
    assert [type(item) for item in response.output] == [
        ResponseReasoningItem,
        ResponseOutputMessage,
        ResponseFunctionToolCall,
    ]
    assert response.output_text == "Moo." and response.metadata == {"a": "b"}
    assert response.tools[0].name == "get_weather"
    assert chat.bodies[-1]["tools"] == [WEATHER] and "stream" not in chat.bodies[-1]
    events = list(client.responses.create(model=DEMO_MODEL_ID, input="Moo?", stream=True))
    assert [e.type for e in events] == ORDER
    assert chat.bodies[-1]["stream_options"] == {"include_usage": True}
    with client.responses.stream(model=DEMO_MODEL_ID, input="Moo?") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Moo." and final.output[2].arguments == '{"city": "Oslo"}'


def test_an_error_once_the_stream_began_is_an_error_event(scripted):
    chat, client = scripted
    chat.failure = ApiError(503, "The engine stopped.", "server_error", code="engine_unavailable")
    chat.fail_after = 3  # the role, then two reasoning deltas
    events = list(client.responses.create(model=DEMO_MODEL_ID, input="Moo?", stream=True))
    assert [e.type for e in events] == [*ORDER[:6], "error"]
    error = events[-1]
    assert (error.code, error.message, error.sequence_number) == (
        "engine_unavailable",
        "The engine stopped.",
        6,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_error_before_the_reply_names_the_responses_parameter(scripted, stream):
    chat, client = scripted
    chat.failure = ApiError(400, "The prompt is too long.", param="messages", code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as caught:  # before the stream began: its own status
        client.responses.create(model=DEMO_MODEL_ID, input="Moo?", stream=stream)
    assert caught.value.body["param"] == "input" and caught.value.code == "context_length_exceeded"
