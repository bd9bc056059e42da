"""The context window: a prompt that fills it is refused with `ContextLengthError`; otherwise the
reply stops with "length" where the window ends, with the tokens an unbounded run gives up to there.

The window is the model's (config.max_position_embeddings) or the request's
`GenerationConfig.context_length` when smaller. Two tiny models from the same seed differ only
in max_position_embeddings (which plain RoPE does not read), so the 512-token one is the
unbounded reference for the 64-token one.
"""

import pytest

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import ContextLengthError, InvalidRequestError
from engine.generation import GenerationConfig, generate_text
from engine.generation_config import SamplingConfig, SpecConfig
from engine.loader import load_model
from engine.offloaded_model import ModelInfo
from engine.tiny.models import make_tiny_model
from engine.worker.protocol import ChatMessage, Generate, decode, encode

WINDOW = 64
CPU = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=8))
GREEDY = SamplingConfig(greedy=True)


def greedy(max_new_tokens: int, **changes) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, sampling=GREEDY, ignore_eos=True, **changes)


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 250 for i in range(n)]


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("short"), seed=5, max_position_embeddings=WINDOW)
    model = load_model(folder, CPU)
    yield model
    model.close()


@pytest.fixture(scope="module")
def long(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("long"), seed=5, max_position_embeddings=512)
    model = load_model(folder, CPU)
    yield model
    model.close()


def test_the_model_info_carries_the_window(short, long):
    assert short.info().context_length == WINDOW and long.info().context_length == 512
    assert ModelInfo.__dataclass_fields__["context_length"].default is None  # not in the config: None


@pytest.mark.parametrize("n", [WINDOW, WINDOW + 6010])
def test_a_prompt_that_fills_the_window_is_refused(short, n):
    with pytest.raises(ContextLengthError) as err:
        generate_text(short, prompt(n), greedy(4))
    assert str(err.value) == (
        f"This model's maximum context length is {WINDOW} tokens. However, your messages resulted in "
        f"{n} tokens. Shorten the conversation or start a new one."
    )
    assert err.value.kind == "context_length_exceeded" and isinstance(err.value, InvalidRequestError)
    assert (err.value.context_length, err.value.prompt_tokens) == (WINDOW, n)


def test_the_reply_stops_with_length_where_the_window_ends(short, long):
    unbounded = generate_text(long, prompt(50), greedy(30))
    capped = generate_text(short, prompt(50), greedy(100))
    assert capped.reason == "length" and len(capped.token_ids) == WINDOW - 50
    assert capped.token_ids == unbounded.token_ids[: WINDOW - 50]
    last = generate_text(short, prompt(WINDOW - 1), greedy(100))
    assert last.reason == "length" and len(last.token_ids) == 1


def test_max_new_tokens_below_the_window_still_applies(short, long):
    capped = generate_text(short, prompt(50), greedy(5))
    assert (
        capped.reason == "length" and capped.token_ids == generate_text(long, prompt(50), greedy(5)).token_ids
    )


def test_speculation_stops_at_the_window_too(short):
    """A verify step drafts no more than the window has room for; greedy self-speculation is lossless."""
    plain = generate_text(short, prompt(50), greedy(100))
    spec = generate_text(short, prompt(50), greedy(100, spec=SpecConfig(mode="self", draft_len=4)))
    assert spec.reason == "length" and spec.token_ids == plain.token_ids


def test_a_request_can_set_a_smaller_window(short, long):
    unbounded = generate_text(long, prompt(50), greedy(30))
    capped = generate_text(long, prompt(50), greedy(30, context_length=56))
    assert capped.reason == "length" and capped.token_ids == unbounded.token_ids[:6]
    with pytest.raises(ContextLengthError) as err:
        generate_text(long, prompt(56), greedy(4, context_length=56))
    assert str(err.value) == (
        "This request's context limit is 56 tokens (the model's is 512). However, your messages "
        "resulted in 56 tokens. Shorten the conversation, start a new one or raise the limit."
    )
    larger = generate_text(short, prompt(50), greedy(100, context_length=1000))  # the model's wins
    assert len(larger.token_ids) == WINDOW - 50


@pytest.mark.parametrize("length", [0, -3, True, 1.5, "64"], ids=repr)
def test_a_bad_request_window_is_refused(length):
    with pytest.raises(
        InvalidRequestError, match=rf"context_length must be a whole number of tokens >= 1 .*got {length!r}"
    ):
        GenerationConfig(context_length=length).validate()


def test_the_request_window_crosses_the_wire():
    request = Generate("g", (ChatMessage("user", "hi"),), GenerationConfig(context_length=300))
    assert decode(encode(request)) == request
    older = encode(Generate("g", (ChatMessage("user", "hi"),)))
    del older["config"]["context_length"]  # a client that does not know the field
    assert decode(older).config.context_length is None


def test_a_model_loaded_with_a_smaller_context_length_stops_and_refuses_there(tmp_path, long):
    """--ctx-size / the Context length setting: below the model's window, for every request."""
    folder = make_tiny_model(tmp_path, seed=5, max_position_embeddings=512)
    model = load_model(
        folder, OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=8), context_length=56)
    )
    try:
        assert model.info().context_limit == 56 and model.info().context_length == 512
        capped = generate_text(model, prompt(50), greedy(30))
        assert (
            capped.reason == "length"
            and capped.token_ids == generate_text(long, prompt(50), greedy(6)).token_ids
        )
        with pytest.raises(
            ContextLengthError, match=r"loaded with a context length of 56 tokens \(the model's is 512\)"
        ):
            generate_text(model, prompt(60), greedy(4))
    finally:
        model.close()


@pytest.mark.parametrize("length", [0, 15, True, 1.5, "64"], ids=repr)
def test_a_bad_context_length_setting_is_refused(length):
    with pytest.raises(
        InvalidRequestError, match=rf"context length must be a whole number of tokens >= 16 .*got {length!r}"
    ):
        OffloadConfig(context_length=length).validate()


def test_the_context_length_setting_crosses_the_wire():
    from engine.worker.protocol import LoadModel

    offload = OffloadConfig(device="cpu", context_length=4096, kv_dtype="bfloat16")
    assert decode(encode(LoadModel("l", None, offload))).offload == offload
