"""Speculation with a prefetch thread on a slow link never computes from a slot in flux.

Randomized (seeded) runs on the smallest cache the loader accepts (top-k slots), over
a link where each copy takes about a millisecond: compute, the prefetch worker and the
link thread all contend for the slots. Every expert computation must read a slot that
is pinned, READY, mapped to the expert computed and holding its bytes; no copy may
start into a pinned slot; the tokens must be the plain greedy ones. A deadlock fails
on the timeout instead of hanging.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from engine.device_cache.expert_cache import Slot, SlotState
from engine.device_cache.stats import PHASES
from engine.generation import generate_text
from engine.metrics import cache_snapshot, phase_delta
from engine.moe.layer import OffloadedExperts
from engine.speculative.decoder import SpecConfig
from tests.engine.spec_helpers import ExpertUses, TinyModels, greedy, load, prompt_for

MODEL_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")  # routers, shared experts, biases
DRAFTERS = ("self", "self-cached", "draft") + (
    ("substitute",) if importlib.util.find_spec("engine.formats.int_quant") else ()
)
POLICIES = ("lru", "lfu", "mrs")
COPY_MS, LATENCY_US = 1.0, 200.0


pytestmark = pytest.mark.usefixtures("one_compute_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("stress"))


class SlotChecker:
    """Wraps acquire, wait, the link's copy and expert compute to check every slot they touch."""

    def __init__(self, model):
        self.cache = model.cache
        self.violations: list[str] = []  # appended from any thread; asserted empty at the end
        self.acquired_for: dict[int, tuple[int, int]] = {}  # slot index -> key acquired (pinned)
        self.computed = self.copies = 0

    @classmethod
    def install(cls, monkeypatch, model) -> SlotChecker:
        checker = cls(model)
        cache = model.cache
        acquire, wait, copy = cache.acquire, cache.wait, cache.transfer.copy
        expert_forward = OffloadedExperts.expert_forward

        def checked_acquire(key, streaming=False):
            slot = acquire(key, streaming)
            checker.acquired_for[slot.index] = key
            return slot

        def checked_wait(slot):
            views = wait(slot)
            checker.check(slot, "after wait")
            return views

        def checked_copy(dst, src, after=None):
            index = (dst.data_ptr() - cache.pool.data_ptr()) // cache.pool.stride(0)
            if cache.slots[index].pins:
                checker.violations.append(f"a copy into slot {index} started while it was pinned")
            checker.copies += 1
            return copy(dst, src, after)

        def checked_expert_forward(experts, x, weights):
            slot = checker.slot_of(weights)
            if slot is not None:  # from a cache slot (substitutes and CPU experts are not)
                checker.check(slot, f"computing layer {experts.layer}")
                if slot.key is None or slot.key[0] != experts.layer:
                    checker.violations.append(f"layer {experts.layer} computed from slot of {slot.key}")
                row = cache.pool[slot.index]
                start, end = row.data_ptr(), row.data_ptr() + row.numel()
                if not all(start <= w.data_ptr() < end for w in weights.values()):
                    checker.violations.append(f"layer {experts.layer} read weights outside its slot")
                checker.computed += 1
            return expert_forward(experts, x, weights)

        monkeypatch.setattr(cache, "acquire", checked_acquire)
        monkeypatch.setattr(cache, "wait", checked_wait)
        monkeypatch.setattr(cache.transfer, "copy", checked_copy)
        monkeypatch.setattr(OffloadedExperts, "expert_forward", checked_expert_forward)
        return checker

    def slot_of(self, weights: dict[str, torch.Tensor]) -> Slot | None:
        """The cache slot whose buffer the weights are views of; None when they are not in the pool."""
        pool = self.cache.pool
        offset = next(iter(weights.values())).data_ptr() - pool.data_ptr()
        if not 0 <= offset < pool.numel():
            return None
        return self.cache.slots[offset // pool.stride(0)]

    def check(self, slot: Slot, where: str) -> None:
        key = self.acquired_for.get(slot.index)
        if slot.pins <= 0:
            self.violations.append(f"{where}: slot {slot.index} is not pinned")
        if slot.state is not SlotState.READY:
            self.violations.append(f"{where}: slot {slot.index} is {slot.state.value}")
        if key is None or slot.key != key:
            self.violations.append(f"{where}: slot {slot.index} holds {slot.key}, acquired for {key}")
        elif not torch.equal(self.cache.pool[slot.index], self.cache.store.buffer(*key)):
            self.violations.append(f"{where}: slot {slot.index} does not hold the bytes of {key}")


def random_spec(rng: random.Random, drafter: str, models: TinyModels, model_type: str) -> SpecConfig:
    settings = {
        "draft_len": rng.randint(1, 6),
        "adapt_draft_len": rng.random() < 0.5,
        "confidence_tau": rng.choice((0.0, 0.03)),  # 0.03 ends about half the tiny drafts' chains
    }
    if drafter == "draft":
        return SpecConfig(mode="draft", draft_model=str(models.near(model_type)), **settings)
    if drafter == "substitute":
        return SpecConfig(mode="substitute", substitute_bits=rng.choice((4, 8)), **settings)
    return SpecConfig(mode="self", top_r=1, cached_only=drafter == "self-cached", **settings)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(4))
def test_speculation_with_prefetch_on_a_slow_link_computes_from_settled_slots(models, monkeypatch, seed):
    rng = random.Random(seed)
    model_type = MODEL_TYPES[seed % len(MODEL_TYPES)]
    folder = models.target(model_type)
    runs = []
    reference = load(folder)  # plain greedy on an ordinary cache
    try:
        expert_nbytes, top_k = reference.store.layout.nbytes, reference.top_k
        for run, drafter in enumerate(rng.sample(DRAFTERS, len(DRAFTERS))):  # each drafter, shuffled
            prompt = prompt_for(rng.randrange(1 << 30), length=rng.randint(2, 40))
            new_tokens = rng.randint(4, 16)
            spec = random_spec(rng, drafter, models, model_type)
            prefetch = ("spmoe", "hybrimoe")[(run + seed) % 2]
            expected = generate_text(reference, prompt, greedy(max_new_tokens=new_tokens)).token_ids
            runs.append((prompt, greedy(spec, prefetch, max_new_tokens=new_tokens), expected))
    finally:
        reference.close()

    model = load(  # the loader's minimum budget: one token's top-k experts
        folder,
        experts=top_k,
        policy=POLICIES[seed % len(POLICIES)],
        sim_link_gbps=expert_nbytes / (COPY_MS * 1e-3) / 1e9,
        sim_latency_us=LATENCY_US,
    )
    try:
        assert model.cache.n_slots == top_k
        uses = ExpertUses.install(monkeypatch, model)
        checker = SlotChecker.install(monkeypatch, model)
        for prompt, config, expected in runs:
            before = cache_snapshot(model.cache)
            finished = generate_text(model, prompt, config)
            assert checker.violations == [], (prompt, config)
            assert finished.token_ids == expected, (prompt, config)
            after = cache_snapshot(model.cache)
            for phase in PHASES:
                delta = phase_delta(before, after, phase)
                assert delta.prefetched == delta.prefetch_used + delta.prefetch_wasted, phase
            assert all(slot.pins == 0 for slot in model.cache.slots)
            assert model.control.observers == ()
        assert checker.computed > 0 and checker.copies > model.cache.n_slots
        total = sum(uses.acquired.values())
        assert total == sum(c.uses for c in model.cache.stats.phases.values())
    finally:
        model.close()
