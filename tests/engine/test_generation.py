"""The generation loop: prefill chunks, sampling, stops, cancellation and streamed text."""

import threading
from typing import ClassVar

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import generation
from engine.config import ExpertBudget, OffloadConfig
from engine.generation import FinishedEvent, GenerationConfig, TokenEvent, generate, generate_text
from engine.loader import load_model
from engine.sampling import SamplingConfig
from engine.tiny.models import make_tiny_model

GREEDY = SamplingConfig(greedy=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), model_type="qwen3_moe", seed=3)


@pytest.fixture
def model(folder):
    loaded = load_model(folder, OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=4)))
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def reference(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def run(model, prompt, config, cancel=None):
    events = list(generate(model, prompt, config, cancel))
    assert isinstance(events[-1], FinishedEvent)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return events[:-1], events[-1]


def test_chunked_prefill_gives_the_same_tokens(model):
    prompt = list(range(30, 100))
    whole = generate_text(
        model, prompt, GenerationConfig(max_new_tokens=12, sampling=GREEDY, ignore_eos=True)
    )
    chunked = generate_text(
        model, prompt, GenerationConfig(max_new_tokens=12, sampling=GREEDY, ignore_eos=True, prefill_chunk=7)
    )
    assert chunked.token_ids == whole.token_ids
    assert chunked.stats.prompt_tokens == 70


def test_sampling_draws_what_transformers_draws(model, reference):
    """Same seed, same processors, same draws: the sampled distribution is transformers'."""
    prompt = torch.tensor([list(range(40, 60))])
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.1)
    torch.manual_seed(1234)
    with torch.no_grad():
        expected = reference.generate(
            prompt,
            do_sample=True,
            temperature=0.8,
            top_p=0.9,
            top_k=20,
            repetition_penalty=1.1,
            max_new_tokens=32,
            min_new_tokens=32,
            eos_token_id=None,
        )[0, 20:]
    torch.manual_seed(1234)
    finished = generate_text(
        model, prompt[0].tolist(), GenerationConfig(max_new_tokens=32, sampling=sampling, ignore_eos=True)
    )
    assert list(finished.token_ids) == expected.tolist()


def test_seeded_sampling_is_reproducible(model):
    config = GenerationConfig(
        max_new_tokens=16, sampling=SamplingConfig(temperature=1.0, seed=7), ignore_eos=True
    )
    first = generate_text(model, "Hello", config)
    second = generate_text(model, "Hello", config)
    assert first.token_ids == second.token_ids


def test_max_new_tokens_ends_with_length(model):
    tokens, finished = run(model, "Hi", GenerationConfig(max_new_tokens=5, sampling=GREEDY, ignore_eos=True))
    assert finished.reason == "length"
    assert [t.token_id for t in tokens] == list(finished.token_ids)
    assert [t.index for t in tokens] == list(range(5))
    assert "".join(t.text for t in tokens) == finished.text


class ScriptedSampler:
    """Stands in for Sampler: emits a fixed token sequence."""

    script: ClassVar[list[int]] = []
    reads_history = False
    logprobs = None  # the requests here ask for none

    def __init__(self, config, device, prompt_tokens=0):
        self.remaining = list(self.script)

    def sample(self, logits, history):
        return self.remaining.pop(0)


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(generation, "Sampler", ScriptedSampler)
    return ScriptedSampler


def test_text_deltas_are_whole_utf8_characters(model, scripted):
    text = "né 🌍 世界!"
    scripted.script = list(text.encode())  # byte-level tokenizer: one token per byte
    tokens, finished = run(model, "x", GenerationConfig(max_new_tokens=len(scripted.script), ignore_eos=True))
    deltas = [t.text for t in tokens]
    assert "".join(deltas) == text == finished.text
    assert "\ufffd" not in "".join(deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # 'é' is two bytes: nothing until both arrived
    assert "🌍" in deltas and "世" in deltas


def test_eos_stops_and_is_not_shown(model, scripted):
    eos = model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    scripted.script = [*b"ok", eos, *b"never"]
    _, finished = run(model, "x", GenerationConfig(max_new_tokens=10))
    assert finished.reason == "eos"
    assert finished.text == "ok"
    assert finished.token_ids[-1] == eos


def test_stop_string_split_across_tokens_is_never_shown(model, scripted):
    scripted.script = list(b"Answer: 42\nUser: more")
    tokens, finished = run(model, "x", GenerationConfig(max_new_tokens=30, stop_strings=("\nUser:",)))
    assert finished.reason == "stop"
    assert finished.text == "Answer: 42"
    assert "".join(t.text for t in tokens) == "Answer: 42"


def test_cancel_stops_between_steps_and_leaves_the_model_usable(model):
    config = GenerationConfig(max_new_tokens=50, sampling=GREEDY, ignore_eos=True)
    fresh = generate_text(model, "Tell me a story", config)
    cancel = threading.Event()
    seen = 0
    for event in generate(model, "Tell me a story", config, cancel):
        if isinstance(event, TokenEvent):
            seen += 1
            if seen == 3:
                cancel.set()
        else:
            finished = event
    assert finished.reason == "cancelled"
    assert len(finished.token_ids) == 3
    assert finished.token_ids == fresh.token_ids[:3]
    again = generate_text(model, "Tell me a story", config)
    assert again.token_ids == fresh.token_ids


def test_messages_go_through_the_chat_template(model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert generation.encode_prompt(model, messages) == list(expected)
    assert generation.encode_prompt(model, "Hi") == generation.encode_prompt(model, messages[1:])


def test_stats_split_prefill_and_decode(model):
    finished = generate_text(model, "Hello there", GenerationConfig(max_new_tokens=8, ignore_eos=True))
    stats = finished.stats
    assert stats.generated_tokens == 8
    assert stats.tpot_ms > 0 and stats.tokens_per_s == pytest.approx(1000 / stats.tpot_ms)
    assert stats.prefill.hits + stats.prefill.misses > 0
    assert stats.hits == stats.prefill.hits + stats.decode.hits
    assert stats.misses == stats.prefill.misses + stats.decode.misses
    assert stats.h2d_bytes == stats.misses * model.store.layout.nbytes
    assert stats.simulated_link is True


@pytest.mark.parametrize(
    ("script", "stop", "tail"),
    [
        (b"ok" + "🌍".encode()[:2], (), "\ufffd"),  # cut inside a character: flushed as a replacement
        (b"done\nUs", ("\nUser:",), "\nUs"),  # a stop string's prefix that never completed
    ],
)
def test_held_back_text_arrives_as_the_tail(model, scripted, script, stop, tail):
    scripted.script = list(script)
    config = GenerationConfig(max_new_tokens=len(script), stop_strings=stop, ignore_eos=True)
    tokens, finished = run(model, "x", config)
    assert finished.reason == "length"
    assert finished.tail == tail
    assert "".join(t.text for t in tokens) + finished.tail == finished.text


def test_the_history_grows_in_place_and_a_view_handed_out_never_changes():
    from engine.generation import _History

    history = _History([7, 8], torch.device("cpu"))
    seen = [history.tokens]
    for token in range(40):  # past several doublings of the buffer
        history.append(token)
        seen.append(history.tokens)
    assert history.tokens.tolist() == [7, 8, *range(40)]
    for length, view in enumerate(seen, start=2):
        assert view.tolist() == [7, 8, *range(length - 2)]


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["greedy", "with-a-repetition-penalty"])
def test_a_plain_step_is_given_the_history_only_where_its_sampler_reads_it(model, monkeypatch, penalty):
    """A greedy sampler on the logits as they are reads no history: its steps are given None (and
    the last token); one with a processor is given every committed token, as before."""
    from engine.speculative.decoder import PlainDecoder

    given, step = [], PlainDecoder.step
    monkeypatch.setattr(
        PlainDecoder, "step", lambda self, history, *a: given.append(history) or step(self, history, *a)
    )
    sampling = SamplingConfig(greedy=True, repetition_penalty=penalty)
    prompt = list(range(40, 50))
    config = GenerationConfig(max_new_tokens=6, sampling=sampling, ignore_eos=True)
    done = generate_text(model, prompt, config)
    assert len(given) == 5
    if penalty == 1.0:
        assert given == [None] * 5
    else:
        assert [h.tolist() for h in given] == [prompt + list(done.token_ids[: n + 1]) for n in range(5)]
