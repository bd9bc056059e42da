"""A prompt continued as written (/v1/completions): no chat template, a suffix in the model's
fill-in-the-middle format, and the prompt echoed with its tokens' log-probabilities as
transformers computes them."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import OffloadConfig
from engine.errors import InvalidRequestError
from engine.generation import generate
from engine.generation_config import CompletionPrompt, GenerationConfig, SamplingConfig
from engine.loader import load_model
from engine.resources import demo_model_dir
from engine.text.prompt_ids import encode_prompt
from tests.engine.coder_model import FIM, save_coder_model
from tests.engine.thinking_model import save_thinking_model

GREEDY = SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def demo():
    model = load_model(demo_model_dir(), OffloadConfig(device="cpu", kernels="exact", dtype="float32"))
    yield model
    model.close()


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """A tiny model whose tokenizer has Qwen2.5-Coder's fill-in-the-middle tokens."""
    folder = save_coder_model(tmp_path_factory.mktemp("coder"))
    loaded = load_model(folder, OffloadConfig(device="cpu", kernels="exact"))
    yield loaded
    loaded.close()


def test_a_completion_prompt_is_the_text_as_written_with_no_template(demo):
    text = "Once upon a time"
    assert encode_prompt(demo, CompletionPrompt(text)) == demo.tokenizer(text)["input_ids"]
    assert encode_prompt(demo, text) != demo.tokenizer(text)["input_ids"], "a plain string is a chat turn"
    assert encode_prompt(demo, CompletionPrompt(token_ids=(5, 6))) == [5, 6]


def test_a_suffix_is_laid_out_in_the_fill_in_the_middle_format(coder):
    ids = encode_prompt(coder, CompletionPrompt("def add(a, b):\n", suffix="\n    return c"))
    tokenizer = coder.tokenizer
    prefix, suffix, middle = tokenizer.convert_tokens_to_ids(FIM)
    assert ids[0] == prefix and ids[-1] == middle
    assert tokenizer.decode(ids[1 : ids.index(suffix)]) == "def add(a, b):\n"
    assert tokenizer.decode(ids[ids.index(suffix) + 1 : -1]) == "\n    return c"
    events = list(
        generate(coder, CompletionPrompt("def add(", suffix=")"), GenerationConfig(max_new_tokens=4))
    )
    assert events[-1].stats.prompt_tokens == 3 + len("def add(") + len(")"), (
        "three FIM tokens, a byte a token"
    )


def test_a_model_without_fill_in_the_middle_tokens_refuses_a_suffix(demo):
    with pytest.raises(InvalidRequestError, match="no fill-in-the-middle tokens"):
        encode_prompt(demo, CompletionPrompt("def f(", suffix=")"))
    with pytest.raises(InvalidRequestError, match="suffix needs the prompt as text"):
        encode_prompt(demo, CompletionPrompt(token_ids=(5,), suffix=")"))


def test_the_echo_carries_the_prompts_logprobs_as_transformers_computes_them(demo):
    text = "The horse ran across the field"
    config = GenerationConfig(max_new_tokens=3, sampling=GREEDY, logprobs=2, prefill_chunk=3)
    list(generate(demo, CompletionPrompt(text), config))  # leaves the prompt in the prefix cache
    events = list(generate(demo, CompletionPrompt(text, echo=True), config))
    echo = events[0].echo
    assert echo is not None and echo.text == text and all(e.echo is None for e in events[1:-1])
    ids = demo.tokenizer(text)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        rows = torch.log_softmax(reference(torch.tensor([ids])).logits[0], dim=-1)
    assert echo.logprobs[0] is None and len(echo.logprobs) == len(ids)
    assert echo.tokens == tuple(demo.tokenizer.decode([i]) for i in ids)
    for position, entry in enumerate(echo.logprobs[1:], start=1):
        expected = rows[position - 1]
        assert entry.token == demo.tokenizer.decode([ids[position]])
        assert entry.logprob == pytest.approx(expected[ids[position]].item(), abs=1e-4)
        assert [lp for _, lp in entry.top] == pytest.approx(expected.topk(2).values.tolist(), abs=1e-4)


def test_an_echo_without_logprobs_is_the_text_alone(demo):
    events = list(
        generate(demo, CompletionPrompt(token_ids=(5, 6, 7), echo=True), GenerationConfig(max_new_tokens=2))
    )
    assert events[0].echo.text == demo.tokenizer.decode([5, 6, 7]) and events[0].echo.logprobs == ()
    assert events[0].logprob is None


def test_a_completion_is_the_text_as_the_model_writes_it_thinking_and_all(tmp_path):
    model = load_model(save_thinking_model(tmp_path), OffloadConfig(device="cpu", kernels="exact"))
    try:
        think = model.tokenizer.convert_tokens_to_ids("</think>")
        bias = SamplingConfig(temperature=0, logit_bias=((think, 100.0),))  # closes the block at once
        prompt = CompletionPrompt("<think>\nMoo")
        events = list(generate(model, prompt, GenerationConfig(max_new_tokens=1, sampling=bias)))
        assert events[-1].reasoning == "" and events[-1].text == "</think>"
        chat = list(generate(model, "Moo", GenerationConfig(max_new_tokens=1, sampling=bias)))
        assert chat[-1].text == "", "a chat reply's thinking is set apart"
    finally:
        model.close()
