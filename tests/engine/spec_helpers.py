"""Tiny targets, their drafts and expert-use bookkeeping for the speculative-decoding tests.

Every draft shares the tiny models' 259-token byte vocabulary: the target itself (it
accepts every token), a *near* draft (the target with noisy weights: some tokens are
accepted, some rejected, so both caches are rewound), a *bad* draft (another random
model: nearly every token is rejected) and a dense draft of another hidden size (SP-MoE
cannot route its residual stream through the target's routers).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import ExpertBudget, OffloadConfig
from engine.device_cache.stats import PHASES, PhaseCounters
from engine.generation import FinishedEvent, GenerationConfig
from engine.loader import load_model
from engine.metrics import Snapshot, cache_snapshot, phase_delta
from engine.offloaded_model import OffloadedModel
from engine.sampling import SamplingConfig
from engine.speculative.decoder import SpecConfig
from engine.tiny.models import build_tiny_model, save_tiny_model, tiny_config, tiny_tokenizer

NEW_TOKENS = 12
GREEDY = SamplingConfig(greedy=True)
TARGET_SEED, BAD_SEED, NOISE_SEED = 1, 2, 7
NEAR_NOISE = 0.1  # relative weight noise of the near draft: about half its tokens are accepted
BUDGET = 4  # experts: twice top-2, a quarter of a layer's 8, so every run evicts


class TinyModels:
    """Tiny model folders under one root, each saved on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._folders: dict[tuple, Path] = {}

    def _saved(self, key: tuple, build) -> Path:
        if key not in self._folders:
            self._folders[key] = save_tiny_model(build(), self.root / "-".join(map(str, key)))
        return self._folders[key]

    def target(self, model_type: str, **overrides) -> Path:
        key = ("target", model_type, *sorted(overrides.items()))
        return self._saved(key, lambda: build_tiny_model(model_type, seed=TARGET_SEED, **overrides))

    def near(self, model_type: str) -> Path:
        """The target with noise of NEAR_NOISE × each tensor's spread on every weight."""

        def build():
            model = build_tiny_model(model_type, seed=TARGET_SEED)
            noise = torch.Generator().manual_seed(NOISE_SEED)
            with torch.no_grad():
                for param in model.parameters():
                    if param.numel() > 1:
                        param.add_(torch.randn(param.shape, generator=noise) * NEAR_NOISE * param.std())
            return model

        return self._saved(("near", model_type), build)

    def bad(self, model_type: str) -> Path:
        return self._saved(("bad", model_type), lambda: build_tiny_model(model_type, seed=BAD_SEED))

    def dense(self, hidden_size: int = 32) -> Path:
        """A dense Qwen3 with the tiny vocabulary and its own hidden size."""

        def build():
            vocab = tiny_config("qwen3_moe").vocab_size
            config = AutoConfig.for_model(
                "qwen3",
                vocab_size=vocab,
                hidden_size=hidden_size,
                intermediate_size=2 * hidden_size,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                max_position_embeddings=512,
                tie_word_embeddings=False,
                eos_token_id=tiny_tokenizer().eos_token_id,
            )
            config._attn_implementation = "eager"
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(BAD_SEED)
                return AutoModelForCausalLM.from_config(config).eval()

        return self._saved(("dense", hidden_size), build)


def prompt_for(seed: int, length: int = 24) -> list[int]:
    """Random byte tokens (ids below 256: no special tokens)."""
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def load(folder: Path, experts: int = BUDGET, **offload) -> OffloadedModel:
    return load_model(
        folder, OffloadConfig(device="cpu", expert_budget=ExpertBudget.parse(experts), **offload)
    )


def greedy(
    spec: SpecConfig | None = None,
    prefetch: str = "none",
    cutoff: int | None = None,
    max_new_tokens: int = NEW_TOKENS,
) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=GREEDY,
        ignore_eos=True,
        spec=spec or SpecConfig(),
        prefetch=prefetch,
        cutoff=cutoff,
    )


class ExpertUses:
    """Counts, per phase, the slots compute acquired from the cache and the distinct experts the
    target's routers chose (summed over MoE calls; not while a drafter reroutes them)."""

    def __init__(self, model: OffloadedModel):
        self.model = model
        self.acquired: Counter[str] = Counter()
        self.routed: Counter[str] = Counter()
        self.moe_calls: Counter[str] = Counter()  # target-routed MoE layer calls

    @classmethod
    def install(cls, monkeypatch, model: OffloadedModel) -> ExpertUses:
        uses = cls(model)
        cache = model.cache
        acquire = cache.acquire

        def counted_acquire(key, streaming=False):
            slot = acquire(key, streaming)  # NoEvictableSlot retries are not uses
            uses.acquired[cache.phase] += 1
            return slot

        monkeypatch.setattr(cache, "acquire", counted_acquire)
        for experts in model.experts.values():
            monkeypatch.setattr(experts, "forward", uses._observed(experts.forward))
        return uses

    def _observed(self, forward):
        def observed(hidden_states, top_k_index, top_k_weights):
            if self.model.control.draft is None:
                phase = self.model.cache.phase
                self.routed[phase] += len(set(top_k_index.reshape(-1).tolist()))
                self.moe_calls[phase] += 1
            return forward(hidden_states, top_k_index, top_k_weights)

        return observed


def check_accounting(
    model: OffloadedModel, before: Snapshot, finished: FinishedEvent, uses: ExpertUses
) -> dict[str, PhaseCounters]:
    """The cache's counters over one run agree with what compute did and with the run's stats."""
    after = cache_snapshot(model.cache)
    delta = {phase: phase_delta(before, after, phase) for phase in PHASES}
    for phase, counters in delta.items():
        context = f"{phase}: {counters}, acquired {uses.acquired}, routed {uses.routed}"
        assert counters.hits + counters.misses == uses.acquired[phase], context
        if phase != "draft":  # a self-draft's top-r routes are not the router's top-k
            assert uses.acquired[phase] == uses.routed[phase], context
        assert counters.prefetched == counters.prefetch_used + counters.prefetch_wasted, context
        reported = getattr(finished.stats, phase)
        assert (reported.hits, reported.misses, reported.prefetched, reported.prefetch_hits) == (
            counters.hits,
            counters.misses,
            counters.prefetched,
            counters.prefetch_hits,
        ), f"{context}, reported {reported}"
    # Each prefetched expert's first use counts once where it was issued and once where it was used.
    assert sum(c.prefetch_hits for c in delta.values()) == sum(c.prefetch_used for c in delta.values())
    assert all(slot.pins == 0 for slot in model.cache.slots)
    assert model.control.observers == () and model.control.draft is None
    return delta
