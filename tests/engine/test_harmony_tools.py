"""gpt-oss's function calls: a harmony message to `functions.NAME` is read as a tool call (either
header order, streamed token by token), kept out of the answer; the chat template renders earlier
calls and the tools' results back; and a forced tool choice on a tiny gpt_oss model is a valid call."""

import pytest

from engine.config import OffloadConfig
from engine.generation import _ReplyText, generate_text
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.loader import load_model
from engine.text.reasoning import one_call_per_message
from engine.text.stream import encode_chat
from engine.worker.protocol import ChatMessage
from tests.engine.harmony_model import harmony_tokenizer, save_harmony_model
from tests.engine.tool_helpers import WEATHER, WEATHER_QUESTION, check_weather_arguments

ANALYSIS = "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant"
ARGS = '{"city":"Paris"}'
CALL_AFTER_CHANNEL = (
    f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"
)
CALL_IN_HEADER = f" to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{ARGS}<|call|>"


@pytest.fixture(scope="module")
def tokenizer():
    return harmony_tokenizer()


def _read(tokenizer, reply: str) -> _ReplyText:
    text = _ReplyText(tokenizer, (), prompt_ids=tokenizer("<|start|>assistant")["input_ids"])
    for token in tokenizer(reply)["input_ids"]:
        text.push(token, is_eos=False)
    text.finish("eos")
    return text


@pytest.mark.parametrize("call", [CALL_AFTER_CHANNEL, CALL_IN_HEADER], ids=["after-channel", "in-header"])
def test_a_message_to_a_function_is_a_call_not_answer_text(tokenizer, call):
    text = _read(tokenizer, ANALYSIS + call)
    function = {"name": "get_weather", "arguments": {"city": "Paris"}}  # parsed, as messages hold them
    assert text.calls == ({"id": "call_0", "type": "function", "function": function},)
    assert text.reasoning == "Need the weather tool." and text.answer == ""


def test_a_built_in_tool_message_is_reasoning_and_a_final_message_the_answer(tokenizer):
    reply = (
        '<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query":"cows"}<|call|>'
        "<|start|>assistant<|channel|>final<|message|>Cows say moo.<|return|>"
    )
    text = _read(tokenizer, reply)
    assert text.calls == () and text.answer == "Cows say moo."
    assert text.reasoning == '{"query":"cows"}'


def test_a_call_cut_at_the_token_limit_is_still_a_call(tokenizer):
    text = _read(tokenizer, CALL_AFTER_CHANNEL.removesuffix("<|call|>")[:-3])
    (call,) = text.calls
    assert call["function"] == {"name": "get_weather", "arguments": ARGS[:-3]}  # not JSON: as written


def test_the_template_renders_calls_and_results_back(tokenizer):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    messages = [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage("assistant", "", (call,)),
        ChatMessage("tool", "18 °C, sunny", tool_call_id="call_1"),
    ]
    ids = encode_chat(tokenizer, [m.to_template() for m in messages], tools=[WEATHER])
    prompt = tokenizer.decode(ids)
    assert "type get_weather = (_: " in prompt
    header = "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
    assert header + '{"city": "Paris"}<|call|>' in prompt  # the arguments object as JSON
    result = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
    assert result + '"18 °C, sunny"<|end|>' in prompt  # the result named by the call before it
    assert prompt.endswith("<|start|>assistant")


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    model = load_model(save_harmony_model(tmp_path_factory.mktemp("harmony")), OffloadConfig(device="cpu"))
    yield model
    model.close()


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_on_a_gpt_oss_model_is_a_valid_call(harmony_model, tool_choice):
    config = GenerationConfig(
        max_new_tokens=60, sampling=SamplingConfig(greedy=True), tools=(WEATHER,), tool_choice=tool_choice
    )
    reply = generate_text(harmony_model, WEATHER_QUESTION, config)
    (call,) = reply.tool_calls
    assert reply.reason == "eos" and reply.text == "" and reply.reasoning == ""
    assert call["function"]["name"] == "get_weather"
    check_weather_arguments(call["function"]["arguments"])


def test_parallel_calls_are_rendered_one_a_message_each_with_its_result(tokenizer):
    def call(n: int, city: str) -> dict:
        function = {"name": "get_weather", "arguments": {"city": city}}
        return {"id": f"call_{n}", "type": "function", "function": function}

    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call(1, "Paris"), call(2, "Oslo")]},
        {"role": "tool", "content": "5 °C", "tool_call_id": "call_2"},  # results in another order
        {"role": "tool", "content": "18 °C", "tool_call_id": "call_1"},
    ]
    split = one_call_per_message(messages)
    assert [(m["role"], m.get("tool_call_id") or m.get("tool_calls", [{}])[0].get("id")) for m in split] == [
        ("user", None),
        ("assistant", "call_1"),
        ("tool", "call_1"),
        ("assistant", "call_2"),
        ("tool", "call_2"),
    ]
    prompt = tokenizer.decode(encode_chat(tokenizer, split, tools=[WEATHER]))
    paris, oslo = prompt.index('{"city": "Paris"}'), prompt.index('{"city": "Oslo"}')
    assert paris < prompt.index('"18 °C"') < oslo < prompt.index('"5 °C"')
    assert one_call_per_message(split) == split  # a history already one call a message is kept
    assert split[3]["content"] == "" and split[1]["content"] == messages[1]["content"]
