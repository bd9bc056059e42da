"""Prefix reuse: a new turn, a regenerate, an edited message prefill only what the kept KV caches do
not hold, and the reply is the cold run's — greedy token for token, seeded sampling too, plain and
speculative, on attention and on Gated DeltaNet (recurrent) models."""

from dataclasses import replace

import pytest
import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.loader import load_model
from engine.model.prefix_cache import PrefixCache
from engine.resources import demo_model_dir
from engine.tiny.models import make_tiny_model

GREEDY = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(greedy=True))
SEEDED = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=0.9, seed=7))
SELF = SpecConfig(mode="self", adapt_draft_len=False, confidence_tau=0.0)
COW = {"role": "user", "content": "What sound does a cow make?"}
HORSE = {"role": "user", "content": "And a horse?"}


@pytest.fixture(scope="module")
def demo():
    model = load_model(demo_model_dir(), OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=24)))
    yield model
    model.close()


def cold(model, prompt, config):
    """The reply with nothing kept: the reference."""
    model.prefix_cache.clear()
    finished = generate_text(model, prompt, config)
    assert finished.stats.cached_prompt_tokens == 0
    return finished


def warm(model, first, prompt, config):
    """The reply to `prompt` after a reply to `first` was kept."""
    model.prefix_cache.clear()
    generate_text(model, first, config)
    return generate_text(model, prompt, config)


@pytest.mark.parametrize("config", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_new_turn_reuses_the_conversation_so_far(demo, config):
    first = generate_text(demo, [COW], config)
    second_turn = [COW, {"role": "assistant", "content": first.text}, HORSE]
    reference = cold(demo, second_turn, config)
    reply = warm(demo, [COW], second_turn, config)
    assert reply.token_ids == reference.token_ids
    # the first turn's prompt and its reply (but the reply's last token, never fed) are held
    assert reply.stats.cached_prompt_tokens >= first.stats.prompt_tokens + len(first.token_ids) - 1
    assert reply.stats.cached_prompt_tokens < reply.stats.prompt_tokens


def test_regenerate_reuses_all_of_the_prompt_but_its_last_token(demo):
    reference = cold(demo, [COW], GREEDY)
    again = generate_text(demo, [COW], GREEDY)
    assert again.token_ids == reference.token_ids
    assert again.stats.cached_prompt_tokens == again.stats.prompt_tokens - 1


def test_an_edited_message_reuses_what_comes_before_it(demo):
    first = [{"role": "system", "content": "Be brief."}, COW]
    edited = [first[0], HORSE]
    reference = cold(demo, edited, GREEDY)
    reply = warm(demo, first, edited, GREEDY)
    assert reply.token_ids == reference.token_ids
    assert 0 < reply.stats.cached_prompt_tokens < reply.stats.prompt_tokens


def test_speculative_replies_reuse_and_equal_the_cold_run(demo):
    config = replace(GREEDY, spec=SELF)
    first = generate_text(demo, [COW], config)
    second_turn = [COW, {"role": "assistant", "content": first.text}, HORSE]
    reference = cold(demo, second_turn, GREEDY)
    reply = warm(demo, [COW], second_turn, config)
    assert reply.token_ids == reference.token_ids and reply.stats.cached_prompt_tokens > 0


def test_a_plain_cache_is_not_reused_for_speculation(demo):
    demo.prefix_cache.clear()
    generate_text(demo, [COW], GREEDY)
    spec = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(greedy=True), spec=SELF)
    assert generate_text(demo, [COW], spec).stats.cached_prompt_tokens == 0


def test_a_failed_reply_keeps_nothing(demo, monkeypatch):
    demo.prefix_cache.clear()
    calls = {"n": 0}
    run = demo._run  # every step, a prefill's and a decode's, goes through it

    def failing(step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return run(step)

    monkeypatch.setattr(demo, "_run", failing)
    with pytest.raises(RuntimeError, match="boom"):
        generate_text(demo, [COW], GREEDY)
    assert len(demo.prefix_cache) == 0


@pytest.fixture(scope="module")
def recurrent(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("next") / "qwen3_next", "qwen3_next")
    model = load_model(folder, OffloadConfig(device="cpu"))
    yield model
    model.close()


@pytest.mark.parametrize("spec", [SpecConfig(), SELF], ids=["plain", "self"])
def test_a_recurrent_state_is_reused_whole_or_from_the_prompts_saved_state(recurrent, spec):
    config = replace(GREEDY, spec=spec)
    prompt = list(range(5, 17))
    first = generate_text(recurrent, prompt, config)
    turn = [*prompt, *first.token_ids, 40, 41, 42]
    reference = cold(recurrent, turn, GREEDY)
    reply = warm(recurrent, prompt, turn, config)
    assert reply.token_ids == reference.token_ids
    assert reply.stats.cached_prompt_tokens == len(prompt) + len(first.token_ids) - 1
    # another continuation of the same prompt: back to the state saved after its prefill
    other = [*prompt, 50, 51]
    reference = cold(recurrent, other, GREEDY)
    reply = warm(recurrent, prompt, other, config)
    assert reply.token_ids == reference.token_ids and reply.stats.cached_prompt_tokens == len(prompt)


def _cache_of(length: int):
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 1, length, 4), torch.zeros(1, 1, length, 4), 0)
    return cache


def test_entries_are_evicted_least_recently_used_by_count_and_bytes():
    kept = PrefixCache(max_entries=2, max_bytes=10_000)
    for first in (1, 2, 3):
        kept.put([first, 9, 9, 9], _cache_of(4), rewindable=False)
    assert len(kept) == 2 and kept.take([1, 9, 9, 9, 5], False) == (None, 0)  # the oldest went
    cache, reused = kept.take([3, 9, 9, 5], False)
    assert reused == 3 and cache.get_seq_length() == 3 and len(kept) == 1  # taken: the caller's
    kept.put(list(range(200)), _cache_of(200), rewindable=False)  # 6.4 kB of keys and values
    kept.put(list(range(300, 500)), _cache_of(200), rewindable=False)
    assert len(kept) == 1 and kept.nbytes <= 10_000


def _growing_cache_of(length: int):
    from transformers import DynamicCache

    from engine.model.kv_cache import GrowingLayer

    cache = DynamicCache()
    cache.layers = [GrowingLayer()]
    cache.update(torch.ones(1, 1, length, 4), torch.ones(1, 1, length, 4), 0)
    return cache


def test_a_cache_let_go_leaves_its_memory_to_the_next_prompt_sharing_nothing(monkeypatch):
    """Cleared, evicted or replaced, a cache of growing layers leaves its buffers as the spare,
    with no positions: the next prompt sharing no prefix (and wanting as rewindable a cache) gets
    it, once, and writes where it did; `close` drops it, and a cache past the spare's size or of
    other layers leaves nothing."""
    from transformers import DynamicCache

    from engine.model import prefix_cache

    kept = PrefixCache(max_entries=1)
    cache = _growing_cache_of(4)
    buffer = cache.layers[0]._buffers[0].data_ptr()
    kept.put([1, 2, 3, 4], cache, rewindable=False)
    kept.clear()
    assert kept.take([7, 8], True) == (None, 0)  # not for a rewindable cache
    spare, reused = kept.take([7, 8], False)
    assert spare is cache and reused == 0 and spare.get_seq_length() == 0
    spare.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)
    assert spare.layers[0]._buffers[0].data_ptr() == buffer and spare.layers[0].keys.sum() == 0
    assert kept.take([7, 8], False) == (None, 0)  # handed out once
    kept.put([1, 2], spare, rewindable=False)
    kept.put([5, 6], _growing_cache_of(2), rewindable=False)  # evicts the first: its memory stays
    assert kept.take([9], False)[0] is spare
    kept.put([1, 2], _growing_cache_of(2), rewindable=False)
    kept.close()
    assert kept.take([9], False) == (None, 0)
    monkeypatch.setattr(prefix_cache, "SPARE_MAX_BYTES", 100)
    for too_big_or_other in (_growing_cache_of(8), DynamicCache()):
        if not too_big_or_other.layers:
            too_big_or_other.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4), 0)
        kept.put([1, 2], too_big_or_other, rewindable=False)
        kept.clear()
        assert kept.take([9], False) == (None, 0)


@pytest.mark.parametrize("config", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_reply_on_the_spare_is_a_fresh_caches(demo, config):
    demo.prefix_cache.close()
    reference = generate_text(demo, [HORSE], config)  # on a cache of its own
    generate_text(demo, [COW], config)
    demo.prefix_cache.clear()  # the cow's cache is the spare now
    reply = generate_text(demo, [HORSE], config)
    assert reply.token_ids == reference.token_ids and reply.stats.cached_prompt_tokens == 0
