"""Tools through the server: the calls a model writes in its `<tool_call>` format come back as
OpenAI `tool_calls` (whole and streamed), tool results go back in as `role: tool`, the tools and
the earlier calls reach the chat template, and the official `openai` client's tool-calling round
trip runs unchanged."""

import json
import threading

import pytest

from app.server.openai_api import ChatBackend
from app.server.openai_server import ApiServer
from app.server.replies import finish_reason
from app.server.tool_calls import ToolCallStream, split_calls, template_calls
from app.session_setup import DEMO_MODEL_ID
from engine.generation_config import GenerationConfig
from engine.text.stream import encode_chat
from engine.tiny.gguf_writer import demo_tokenizer
from engine.worker.protocol import ChatMessage, Finished, Generate, Token, dumps, loads

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + "\n" + CALL.replace("Paris", "Oslo")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _streamed(text: str, chunks: list[str]) -> tuple[str, list]:
    stream = ToolCallStream()
    content = "".join(stream.feed(c) for c in chunks)
    rest, calls = stream.finish()
    return content + rest, calls


@pytest.mark.parametrize(
    ("text", "content", "cities"),
    [
        (CALL, "", ["Paris"]),
        ("Let me look.\n" + TWO_CALLS, "Let me look.\n", ["Paris", "Oslo"]),
        ("No call, just <tool text.", "No call, just <tool text.", []),
        ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
        ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
        (CALL[:-12], "", ["Paris"]),  # cut at max_tokens before its closing tag: still a call
    ],
)
def test_calls_are_split_from_the_text_however_it_streams(text, content, cities):
    for chunks in ([text], list(text), [text[: len(text) // 2], text[len(text) // 2 :]]):
        found, calls = _streamed(text, chunks)
        assert found == content
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == cities
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert split_calls(text)[0] == content


def test_earlier_calls_and_tool_results_reach_the_template_with_the_tools():
    tokenizer = demo_tokenizer()
    tokenizer.chat_template = (  # the Hermes/Qwen way of writing tools, calls and results
        "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
        "{{ c.function.arguments.city }}</tool_call>{% endfor %}"
        "{%- if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    calls = template_calls(split_calls(CALL)[1])
    messages = [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", calls),
        ChatMessage("tool", "18 °C, sunny", tool_call_id=calls[0]["id"]),
    ]
    config = GenerationConfig(tools=(WEATHER,))
    request = loads(dumps(Generate("r", tuple(messages), config)))  # as the worker receives it
    assert request.messages == tuple(messages) and request.config.tools == (WEATHER,)
    ids = encode_chat(tokenizer, [m.to_template() for m in request.messages], **config.template_arguments())
    prompt = tokenizer.decode(ids)
    assert '"name": "get_weather"' in prompt and "<tool_call>get_weather Paris</tool_call>" in prompt
    assert f"18 °C, sunny for {calls[0]['id']}" in prompt


class ScriptedSession:
    """Stands in for `EngineSession`: each `generate` streams the next scripted reply text."""

    alive = True

    def restart(self) -> None:
        pass

    def __init__(self, *replies: str):
        self.replies, self.asked, self.restarts = list(replies), [], 0
        self.lock = threading.Lock()

    def generate(self, messages, config, completion=None):
        self.asked.append((list(messages), config))
        text = self.replies.pop(0)
        for n, piece in enumerate(text[i : i + 7] for i in range(0, len(text), 7)):
            yield Token("r", piece, n, n, 1.0)
        yield Finished("r", "eos", text, "", 10, 5, {})


@pytest.fixture
def served():
    session = ScriptedSession(CALL, "It is 18 °C and sunny in Paris.", TWO_CALLS)
    backend = ChatBackend(session, DEMO_MODEL_ID, GenerationConfig())
    server = ApiServer(backend, port=0).start()
    yield session, server
    server.stop()
    backend.close()


def test_the_openai_clients_tool_round_trip(served):
    import openai

    session, server = served
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
    try:
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(model=DEMO_MODEL_ID, messages=messages, tools=[WEATHER])
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Paris"
        }
        messages += [choice.message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": call.id, "content": "18 °C, sunny"}]
        answer = client.chat.completions.create(model=DEMO_MODEL_ID, messages=messages, tools=[WEATHER])
        assert answer.choices[0].message.content == "It is 18 °C and sunny in Paris."
        assert answer.choices[0].finish_reason == "stop"
        asked, config = session.asked[1]
        assert config.tools[0]["function"]["name"] == "get_weather"
        assert asked[1].tool_calls[0]["function"]["arguments"] == {
            "city": "Paris"
        }  # an object, for templates
        assert asked[2] == ChatMessage("tool", "18 °C, sunny", tool_call_id=call.id)

        chunks = list(
            client.chat.completions.create(
                model=DEMO_MODEL_ID, messages=messages[:1], tools=[WEATHER], stream=True
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == ""
        streamed = [tc for d in deltas for tc in d.tool_calls or []]
        assert [json.loads(tc.function.arguments)["city"] for tc in streamed] == ["Paris", "Oslo"]
        assert [tc.index for tc in streamed] == [0, 1]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        client.close()


def test_tool_choice_none_sends_no_tools(served):
    import openai

    session, server = served
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
    try:
        reply = client.chat.completions.create(
            model=DEMO_MODEL_ID,
            messages=[{"role": "user", "content": "Hi"}],
            tools=[WEATHER],
            tool_choice="none",
        )
    finally:
        client.close()
    assert session.asked[0][1].tools == ()
    assert reply.choices[0].message.tool_calls is None  # without tools the text is not read for calls
    assert "<tool_call>" in reply.choices[0].message.content


def test_a_call_cut_by_the_token_limit_is_a_partial_call_never_markup():
    cut = ToolCallStream()
    assert cut.feed('<tool_call>\n{"name":"get_weather","arguments":{"city":"Par') == ""
    content, calls = cut.finish()
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Par'}
    name_cut = ToolCallStream()
    name_cut.feed('<tool_call>\n{"name":"get_w')
    assert name_cut.finish() == ("", [])  # nothing to call yet, and no markup as content
    no_call = ToolCallStream()
    no_call.feed("<tool_call>\nnot json\n</tool_call>")
    assert no_call.finish() == ("<tool_call>\nnot json\n</tool_call>", [])  # a closed block: as written


def test_a_reply_the_token_limit_cut_finishes_with_length_even_with_calls():
    def finished(reason: str) -> Finished:
        return Finished("r", reason, "", "", 1, 1, {})

    assert finish_reason(finished("length"), called=True) == "length", "its call is partial"
    assert finish_reason(finished("eos"), called=True) == "tool_calls"
    assert finish_reason(finished("stop")) == "stop" and finish_reason(finished("eos")) == "stop"
