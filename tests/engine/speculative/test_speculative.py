"""Speculative decoding is lossless, rewinds its caches and accounts for every expert use.

Every tiny architecture, drafter (a separate draft model, SS-MoE self-draft with and
without `cached_only`, SubSpec substitutes) and prefetch policy gives, greedily, exactly
the plain greedy tokens on a cache of four slots (it evicts all the time). The target
used as its own draft accepts every token; a random draft of the same vocabulary
accepts almost none and changes nothing. Steps that fail or are cancelled leave the KV
cache holding exactly the committed tokens but the last.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from engine.device_cache.expert_cache import STREAM_DEPTH
from engine.errors import EngineError
from engine.generation import FinishedEvent, GenerationConfig, TokenEvent, generate, generate_text
from engine.metrics import cache_snapshot
from engine.sampling import Sampler, SamplingConfig
from engine.speculative.decoder import SpecConfig, open_decoder
from engine.speculative.prefetch import PREFETCH_POLICIES
from engine.tiny.models import TINY_ARCHITECTURES
from tests.engine.spec_helpers import (
    GREEDY,
    NEW_TOKENS,
    ExpertUses,
    TinyModels,
    check_accounting,
    greedy,
    load,
    prompt_for,
)

DRAFTERS = ("draft", "self", "self-cached", "substitute")
PROMPT_LEN = 24  # prompt_for's default


pytestmark = pytest.mark.usefixtures("one_compute_thread")


def spec_for(drafter: str, models: TinyModels, model_type: str, **settings) -> SpecConfig:
    """`drafter`'s SpecConfig; 'draft' uses the near draft, which both accepts and rejects.

    No confidence stop unless asked: tiny random models are unsure of every token (0.02–0.05),
    so the default threshold would end every draft after one token.
    """
    settings.setdefault("confidence_tau", 0.0)
    if drafter == "substitute":
        pytest.importorskip(
            "engine.formats.int_quant", reason="substitute experts need engine.formats.int_quant"
        )
        return SpecConfig(mode="substitute", **settings)
    if drafter == "draft":
        return SpecConfig(mode="draft", draft_model=str(models.near(model_type)), **settings)
    return SpecConfig(mode="self", top_r=1, cached_only=drafter == "self-cached", **settings)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def plain(models):
    """model_type -> the plain greedy tokens (no speculation, no prefetch), computed once."""
    tokens: dict[str, tuple[int, ...]] = {}

    def plain_tokens(model_type: str) -> tuple[int, ...]:
        if model_type not in tokens:
            model = load(models.target(model_type))
            try:
                tokens[model_type] = generate_text(model, prompt_for(0), greedy()).token_ids
            finally:
                model.close()
        return tokens[model_type]

    return plain_tokens


@pytest.fixture
def target(models):
    """Loads a fresh target of a model type; closes it after the test."""
    loaded = []

    def load_target(model_type: str, **offload):
        loaded.append(load(models.target(model_type), **offload))
        return loaded[-1]

    yield load_target
    for model in loaded:
        model.close()


# -- losslessness and accounting ------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", PREFETCH_POLICIES)
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_speculative_greedy_is_plain_greedy(
    models, plain, target, monkeypatch, model_type, drafter, prefetch
):
    spec = spec_for(drafter, models, model_type)
    model = target(model_type)
    uses = ExpertUses.install(monkeypatch, model)
    before = cache_snapshot(model.cache)

    finished = generate_text(model, prompt_for(0), greedy(spec, prefetch))

    assert finished.token_ids == plain(model_type)
    stats = finished.stats
    assert stats.spec == spec.mode and stats.verify_steps > 0
    delta = check_accounting(model, before, finished, uses)
    assert sum(c.copies for c in delta.values()) > model.cache.n_slots, "the cache must evict"
    # after the prefill every target forward drafts or verifies, but for a last token on its own
    assert uses.moe_calls["decode"] in (0, len(model.experts))
    assert uses.moe_calls["verify"] == stats.verify_steps * len(model.experts)
    if drafter in ("draft", "substitute"):
        assert delta["draft"].uses == 0, "a draft model and substitutes never touch the cache"
    if prefetch == "none":
        assert all(c.prefetched == 0 for c in delta.values())
    if prefetch == "spmoe":  # while drafting; and streaming ahead in target forwards that stream,
        # at most STREAM_DEPTH experts per layer (a lone last token streams when the cache is this small)
        assert delta["draft"].prefetched + delta["verify"].prefetched > 0
        assert delta["decode"].prefetched <= STREAM_DEPTH * uses.moe_calls["decode"]


@pytest.mark.parametrize(
    ("model_type", "prefetch"),
    [(t, "none") for t in TINY_ARCHITECTURES] + [("qwen3_moe", "next-layer"), ("qwen3_moe", "hybrimoe")],
)
def test_plain_decoding_uses_top_k_experts_per_layer_per_token(
    plain, target, monkeypatch, model_type, prefetch
):
    model = target(model_type)
    uses = ExpertUses.install(monkeypatch, model)
    before = cache_snapshot(model.cache)

    finished = generate_text(model, prompt_for(0), greedy(prefetch=prefetch))

    assert finished.token_ids == plain(model_type)
    delta = check_accounting(model, before, finished, uses)
    assert delta["decode"].uses == len(model.experts) * model.top_k * (NEW_TOKENS - 1)
    assert delta["draft"].uses == delta["verify"].uses == 0
    assert finished.stats.verify_steps == 0 and finished.stats.accept_len is None


# -- acceptance ---------------------------------------------------------------------------------


def own_draft_steps(draft_len: int) -> list[int]:
    """Tokens each verify step emits when every draft token is accepted.

    The first token comes from the prefill. A step drafts no more than the tokens still wanted
    but one (the verify adds one of its own), and a last token on its own takes a plain step.
    """
    steps, wanted = [], NEW_TOKENS - 1
    while wanted > 1:
        steps.append(min(draft_len + 1, wanted))
        wanted -= steps[-1]
    return steps


def fixed_own_draft(models, model_type: str, draft_len: int) -> SpecConfig:
    """The target as its own draft, γ fixed and no confidence stop (a tiny random model is unsure)."""
    return SpecConfig(
        mode="draft",
        draft_model=str(models.target(model_type)),
        draft_len=draft_len,
        adapt_draft_len=False,
        confidence_tau=0.0,
    )


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_target_as_its_own_draft_accepts_every_token(models, plain, target, model_type):
    spec = fixed_own_draft(models, model_type, draft_len=3)
    finished = generate_text(target(model_type), prompt_for(0), greedy(spec))

    assert finished.token_ids == plain(model_type)
    stats, steps = finished.stats, own_draft_steps(3)
    assert stats.acceptance_rate == 1.0
    assert stats.verify_steps == len(steps) == 3  # 4 + 4 + 3 tokens
    assert stats.accept_len == pytest.approx(sum(steps) / len(steps))
    assert stats.draft_len == pytest.approx(sum(steps) / len(steps) - 1)


@pytest.mark.parametrize("draft_len", [1, 6])
def test_own_draft_accepts_every_token_at_any_fixed_length(models, plain, target, draft_len):
    spec = fixed_own_draft(models, "qwen3_moe", draft_len)
    finished = generate_text(target("qwen3_moe"), prompt_for(0), greedy(spec, "spmoe"))
    assert finished.token_ids == plain("qwen3_moe")
    steps = own_draft_steps(draft_len)
    assert finished.stats.acceptance_rate == 1.0
    assert finished.stats.verify_steps == len(steps)
    assert finished.stats.accept_len == pytest.approx(sum(steps) / len(steps))


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_a_bad_draft_changes_nothing(models, plain, target, model_type):
    spec = SpecConfig(
        mode="draft", draft_model=str(models.bad(model_type)), adapt_draft_len=False, confidence_tau=0.0
    )
    finished = generate_text(target(model_type), prompt_for(0), greedy(spec))
    assert finished.token_ids == plain(model_type)
    assert finished.stats.acceptance_rate <= 0.25
    assert finished.stats.accept_len < 1.5


def test_a_dense_draft_of_another_width_is_lossless_and_spmoe_falls_back(models, plain, target):
    spec = SpecConfig(mode="draft", draft_model=str(models.dense(hidden_size=32)), confidence_tau=0.0)
    finished = generate_text(target("qwen3_moe"), prompt_for(0), greedy(spec, "spmoe"))
    assert finished.token_ids == plain("qwen3_moe")
    assert finished.stats.prefetch.startswith("next-layer (spmoe fallback")


@pytest.mark.parametrize(
    ("spec", "prefetch"),
    [(SpecConfig(), "spmoe"), (SpecConfig(mode="draft", draft_model="/nonexistent/draft"), "none")],
    ids=["spmoe-without-speculation", "missing-draft-model"],
)
def test_a_rejected_request_leaves_nothing_installed(target, spec, prefetch):
    model = target("qwen3_moe")
    config = dataclasses.replace(greedy(spec, prefetch), cpu_experts="always")
    with pytest.raises(EngineError):
        generate_text(model, prompt_for(0), config)
    assert model.control.observers == () and model.control.draft is None
    assert model.control.hybrid is None, "CPU execution stayed installed after a rejected request"


# -- sampling -------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_seeded_speculative_sampling_is_reproducible_and_in_vocabulary(models, target, monkeypatch, drafter):
    spec = spec_for(drafter, models, "qwen3_moe")
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=11),
        ignore_eos=True,
        spec=spec,
        prefetch="spmoe",
    )
    model = target("qwen3_moe")
    uses = ExpertUses.install(monkeypatch, model)
    before = cache_snapshot(model.cache)

    first = generate_text(model, prompt_for(1), config)

    check_accounting(model, before, first, uses)
    second = generate_text(model, prompt_for(1), config)
    assert first.reason == "length" and len(first.token_ids) == NEW_TOKENS
    assert all(0 <= t < model.hf_config.vocab_size for t in first.token_ids)
    assert second.token_ids == first.token_ids
    assert first.stats.lossless and first.stats.verify_steps > 0


def test_adaptive_acceptance_is_labelled_lossy(models, target):
    spec = spec_for("draft", models, "qwen3_moe", acceptance="adaptive")
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        sampling=SamplingConfig(temperature=0.9, seed=3),
        ignore_eos=True,
        spec=spec,
    )
    finished = generate_text(target("qwen3_moe"), prompt_for(1), config)
    assert len(finished.token_ids) == NEW_TOKENS
    assert finished.stats.lossless is False


# -- KV cache rollback ----------------------------------------------------------------------------


def prefill(model, prompt: list[int]) -> tuple[torch.Tensor, object]:
    """As generate() starts: the prompt in the KV cache, the first token appended to the history."""
    kv_cache = model.new_kv_cache(rewindable=True)
    history = torch.tensor(prompt)
    model.cache.phase = "prefill"
    logits = model.forward(history, kv_cache)[-1]
    model.cache.phase = "decode"
    return torch.cat([history, history.new_tensor([int(logits.argmax())])]), kv_cache


def rollback_spec(drafter: str, models: TinyModels, model_type: str = "qwen3_moe") -> SpecConfig:
    if drafter == "bad-draft":
        return SpecConfig(
            mode="draft", draft_model=str(models.bad(model_type)), adapt_draft_len=False, confidence_tau=0.0
        )
    return spec_for(drafter, models, model_type, adapt_draft_len=False)


# qwen3_next: Gated DeltaNet layers whose recurrent state goes back by a saved copy, not a crop
REWOUND = ("qwen3_moe", "qwen3_next")


@pytest.mark.parametrize("model_type", REWOUND)
@pytest.mark.parametrize("drafter", ["draft", "bad-draft", "self", "self-cached", "substitute"])
def test_each_step_leaves_the_committed_tokens_but_the_last_in_the_kv_cache(
    models, plain, target, drafter, model_type
):
    spec = rollback_spec(drafter, models, model_type)
    model = target(model_type)
    history, kv_cache = prefill(model, prompt_for(0))
    decoder = open_decoder(model, spec, "none", None, Sampler(GREEDY))
    try:
        while len(history) < PROMPT_LEN + NEW_TOKENS:
            tokens = decoder.step(history, kv_cache)
            assert 1 <= len(tokens) <= spec.draft_len + 1
            history = torch.cat([history, history.new_tensor(tokens)])
            assert kv_cache.get_seq_length() == len(history) - 1
            if spec.mode == "draft":
                assert decoder.drafter.kv_cache.get_seq_length() <= len(history) - 1
    finally:
        decoder.close()
    assert tuple(history[PROMPT_LEN : PROMPT_LEN + NEW_TOKENS].tolist()) == plain(model_type)


@pytest.mark.parametrize("model_type", REWOUND)
@pytest.mark.parametrize(
    ("drafter", "failing_phase"), [("self", "verify"), ("self", "draft"), ("draft", "verify")]
)
def test_a_failing_step_rewinds_the_kv_cache(
    models, plain, target, monkeypatch, drafter, failing_phase, model_type
):
    spec = rollback_spec(drafter, models, model_type)
    model = target(model_type)
    history, kv_cache = prefill(model, prompt_for(0))
    decoder = open_decoder(model, spec, "spmoe", None, Sampler(GREEDY))
    try:
        tokens = decoder.step(history, kv_cache)  # one good step first: the caches hold drafts' past
        history = torch.cat([history, history.new_tensor(tokens)])
        forward = model.forward

        def failing_forward(ids, kv, logits_to_keep=1):
            if model.cache.phase == failing_phase:
                forward(ids, kv, logits_to_keep)  # fail after writing into the KV cache
                raise RuntimeError("injected failure")
            return forward(ids, kv, logits_to_keep)

        monkeypatch.setattr(model, "forward", failing_forward)
        with pytest.raises(RuntimeError, match="injected failure"):
            decoder.step(history, kv_cache)
        assert kv_cache.get_seq_length() == len(history) - 1
        assert model.cache.phase == "decode"
        assert model.control.draft is None
        assert all(slot.pins == 0 for slot in model.cache.slots)
        if spec.mode == "draft":
            assert decoder.drafter.kv_cache.get_seq_length() <= len(history) - 1

        monkeypatch.setattr(model, "forward", forward)
        while len(history) < PROMPT_LEN + NEW_TOKENS:
            history = torch.cat([history, history.new_tensor(decoder.step(history, kv_cache))])
            assert kv_cache.get_seq_length() == len(history) - 1
    finally:
        decoder.close()
    assert tuple(history[PROMPT_LEN : PROMPT_LEN + NEW_TOKENS].tolist()) == plain(model_type)


@pytest.mark.parametrize("model_type", REWOUND)
@pytest.mark.parametrize("drafter", ["draft", "self"])
def test_cancel_mid_generation_then_generate_again(models, plain, target, drafter, model_type):
    model = target(model_type)
    config = greedy(spec_for(drafter, models, model_type), "spmoe")
    threads_before = set(threading.enumerate())
    cancel = threading.Event()
    events = []
    for event in generate(model, prompt_for(0), config, cancel):
        events.append(event)
        if isinstance(event, TokenEvent) and event.index == 4:
            cancel.set()  # mid-step: the step emitted more tokens than will be kept

    finished = events[-1]
    assert isinstance(finished, FinishedEvent) and finished.reason == "cancelled"
    assert finished.token_ids == plain(model_type)[:5]
    assert model.control.observers == () and model.control.draft is None
    assert all(slot.pins == 0 for slot in model.cache.slots)
    prefetch_threads = [t for t in set(threading.enumerate()) - threads_before if t.name == "expert-prefetch"]
    assert not prefetch_threads, "the prefetch worker outlived its run"

    assert generate_text(model, prompt_for(0), greedy()).token_ids == plain(model_type)
    assert generate_text(model, prompt_for(0), config).token_ids == plain(model_type)
