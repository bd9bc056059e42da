"""Reasoning apart from the answer: `<think>` blocks split from the stream at any chunking, the
chat template's `enable_thinking` honoured, and a thinking model's reply split end to end."""

import pytest

from engine.config import OffloadConfig
from engine.errors import InvalidRequestError
from engine.generation import FinishedEvent, TokenEvent, _ReplyText, encode_prompt, generate
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.loader import load_model
from engine.text.reasoning import ThinkSplitter, harmony_splitter_for, splitter_for, thinks, vocabulary
from engine.tiny.gguf_writer import demo_tokenizer
from tests.engine.harmony_model import harmony_tokenizer
from tests.engine.thinking_model import save_thinking_model, thinking_tokenizer

# (streamed text, the prompt opened the block) -> (reasoning, answer)
CASES = [
    ("<think>\nLet me see.\n</think>\n\nA cow says moo.", False, "Let me see.\n", "A cow says moo."),
    ("Let me see.</think>\n\nMoo.", True, "Let me see.", "Moo."),
    ("No thinking, <b>bold</b> and <thin air.", False, "", "No thinking, <b>bold</b> and <thin air."),
    ("\n\nstill thinking <thin", True, "still thinking <thin", ""),
    ("<think></think>Answer with <think> in it", False, "", "Answer with <think> in it"),
]


def _split(chunks: list[str], inside: bool) -> tuple[str, str]:
    splitter = ThinkSplitter(inside)
    parts = [splitter.feed(chunk) for chunk in chunks] + [splitter.flush()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


@pytest.mark.parametrize(("text", "inside", "reasoning", "answer"), CASES)
def test_the_split_is_the_same_however_the_text_is_chunked(text, inside, reasoning, answer):
    assert _split([text], inside) == (reasoning, answer)
    assert _split(list(text), inside) == (reasoning, answer)  # a character at a time
    for cut in range(1, len(text)):  # every two-piece cut
        assert _split([text[:cut], text[cut:]], inside) == (reasoning, answer), cut


def test_only_a_model_with_think_tokens_is_parsed():
    assert not thinks(demo_tokenizer()) and splitter_for(demo_tokenizer(), [1, 2]) is None
    tokenizer = thinking_tokenizer()
    assert thinks(tokenizer)
    opened = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    closed = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=False
    )
    assert splitter_for(tokenizer, opened["input_ids"]).inside
    assert not splitter_for(tokenizer, closed["input_ids"]).inside


def test_a_tokenizers_vocabulary_is_asked_of_it_once(monkeypatch):
    """Every request looks its think and harmony tokens up: a 151k vocabulary's `get_vocab()`
    takes ~80 ms, so it is asked once a tokenizer."""
    tokenizer = thinking_tokenizer()
    calls = []
    get_vocab = tokenizer.get_vocab
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: calls.append(1) or get_vocab())
    for _ in range(3):
        assert thinks(tokenizer) and harmony_splitter_for(tokenizer) is None
    assert len(calls) == 1
    assert vocabulary(tokenizer) == get_vocab() and vocabulary(None) == {}


def test_the_reply_text_splits_token_by_token_with_a_stop_string():
    tokenizer = thinking_tokenizer()
    ids = tokenizer("<think>\nplan the answer\n</think>\n\nA cow says moo. END more")["input_ids"]
    assert tokenizer.convert_tokens_to_ids("</think>") in ids  # the tag is one token
    reply = _ReplyText(tokenizer, ("END",), prompt_ids=tokenizer("<|im_start|>assistant\n")["input_ids"])
    streamed = [reply.push(token, is_eos=False) for token in ids]
    stopped_at = next(n for n, (_, _, stopped) in enumerate(streamed) if stopped)
    reason, (thought_tail, tail) = reply.finish("stop")
    assert reason == "stop" and stopped_at < len(ids) - 1
    assert "".join(t for t, _, _ in streamed) + thought_tail == reply.reasoning == "plan the answer\n"
    assert "".join(a for _, a, _ in streamed) + tail == reply.answer == "A cow says moo. "


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    model = load_model(save_thinking_model(tmp_path_factory.mktemp("thinking")), OffloadConfig(device="cpu"))
    yield model
    model.close()


GREEDY = SamplingConfig(greedy=True)
HI = [{"role": "user", "content": "Hi"}]


def _run(model, config: GenerationConfig) -> tuple[list[TokenEvent], FinishedEvent]:
    events = list(generate(model, HI, config))
    return events[:-1], events[-1]


def test_a_prompt_opened_block_makes_the_reply_reasoning(thinking_model):
    tokens, finished = _run(thinking_model, GenerationConfig(max_new_tokens=12, sampling=GREEDY))
    close = thinking_model.tokenizer.convert_tokens_to_ids("</think>")
    assert close not in finished.token_ids  # a random model never closes it: all of it is reasoning
    assert finished.text == "" and all(t.text == "" for t in tokens)
    whole = thinking_model.tokenizer.decode(list(finished.token_ids)).strip()
    assert finished.reasoning.strip() == whole != ""
    assert "".join(t.reasoning for t in tokens) + finished.reasoning_tail == finished.reasoning


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_all_answer(thinking_model):
    config = GenerationConfig(max_new_tokens=12, sampling=GREEDY, template_kwargs={"enable_thinking": False})
    prompt = encode_prompt(thinking_model, HI, config.template_kwargs)
    assert thinking_model.tokenizer.decode(prompt).endswith("<think>\n\n</think>\n\n")
    tokens, finished = _run(thinking_model, config)
    assert finished.reasoning == "" and all(t.reasoning == "" for t in tokens)
    assert finished.text == "".join(t.text for t in tokens) + finished.tail != ""


@pytest.mark.parametrize(
    "kwargs", [{"tokenize": True}, {"messages": []}, {"bad name": 1}, {"effort": [1, 2]}, {"x": {"a": 1}}]
)
def test_template_arguments_the_request_may_not_set_are_refused(kwargs):
    with pytest.raises(InvalidRequestError):
        GenerationConfig(template_kwargs=kwargs).validate()


def test_harmony_channels_split_into_reasoning_and_answer():
    tokenizer = harmony_tokenizer()
    reply = (
        "<|channel|>analysis<|message|>User says hi. Reply warmly.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
    )
    ids = tokenizer(reply)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|channel|>") in ids  # control tokens are one token each
    text = _ReplyText(tokenizer, (), prompt_ids=tokenizer("<|start|>assistant")["input_ids"])
    assert text.harmony is not None and text.thoughts is None
    streamed = [text.push(token, is_eos=False) for token in ids]
    _, (thought_tail, tail) = text.finish("eos")
    assert text.reasoning == "User says hi. Reply warmly." and text.answer == "Hello! How can I help?"
    assert "".join(t for t, _, _ in streamed) + thought_tail == text.reasoning
    assert "".join(a for _, a, _ in streamed) + tail == text.answer
    assert "analysis" not in text.answer + text.reasoning and "assistant" not in text.answer


def test_a_model_without_harmony_tokens_is_not_read_as_harmony():
    assert harmony_splitter_for(demo_tokenizer()) is None
    assert harmony_splitter_for(harmony_tokenizer()) is not None


def test_a_forced_call_closes_the_think_block_the_prompt_opened(thinking_model):
    tool = {"type": "function", "function": {"name": "get_time"}}
    config = GenerationConfig(max_new_tokens=80, sampling=GREEDY, tools=(tool,), tool_choice="required")
    _, finished = _run(thinking_model, config)
    assert finished.reason == "eos" and finished.reasoning == ""  # the call is the answer, not a thought
    assert finished.text == '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>'
