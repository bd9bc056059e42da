"""Decoding steps: plain (one token per target forward) and speculative (draft, verify, accept).

A decoder's `step(history, kv_cache, wanted, last)` takes every committed token (`history [L]`,
whose last token the target has not seen yet: the KV cache holds L−1 positions)
and returns the next tokens; `wanted` is how many more the caller can use (the rest of
`max_new_tokens`), so no step drafts tokens that could never be emitted; `last`, where the caller
has it, is history's last token as an int (not read back from the tensor). A decoder whose
`reads_history` is False (a plain one whose sampler reads none: greedy on the logits as they
are) is given None for `history` and `last`'s int: a view of the history each token costs a CPU
decode step more than it should, where the weights leave the interpreter's caches cold.
A speculative step reads top to bottom:

    draft     the drafter proposes up to γ tokens (prefetching verification's experts meanwhile)
    verify    one target forward over [last, d1 … dγ] gives γ+1 next-token distributions
    accept    greedy exact match, or rejection sampling (both lossless), or SS-MoE's
              adaptive rule (opt-in, not lossless); plus the correction or bonus token
    rewind    the target's and the drafter's KV caches drop everything past the accepted
              prefix; a try/finally rewinds even when a step fails, so the caches always
              hold exactly the committed tokens but the last

The decoder is the one place that rewinds caches: a self-drafter's entries in the target's
cache are dropped after the draft (`_draft`), and both caches go back to the accepted
prefix at the end of a step (`_rewind`). `open_decoder` installs the run's prefetch policy
and CPU execution on the model's `ExpertControl`; `close()` restores it.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from engine.device_cache.expert_cache import STREAM_DEPTH
from engine.generation_config import (  # noqa: F401  (SPEC_MODES is re-exported)
    SPEC_MODES,
    SamplingConfig,
    SpecConfig,
    derived_seed,
)
from engine.metrics import SpecSummary
from engine.model.kv_cache import RecurrentState, rewind_cache
from engine.moe.cpu_misses import HybridExecutor
from engine.sampling import Sampler
from engine.speculative.acceptance import Verdict, adaptive_accept, greedy_accept, rejection_accept
from engine.speculative.auto import resolve as resolve_auto
from engine.speculative.cutoff import CutoffInputs, choose_cutoff
from engine.speculative.draft_len import DraftLengthController, unique_experts
from engine.speculative.drafters import Drafter, ModelDrafter, SelfDrafter, SubstituteDrafter
from engine.speculative.mtp import MtpDrafter
from engine.speculative.prefetch import Prefetch, SpMoePredictor, install_prefetch

log = logging.getLogger(__name__)


@dataclass
class SpecCounters:
    """What speculation did over a run."""

    steps: int = 0  # verify steps
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens returned by verify steps (accepted + one correction or bonus each)
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def accept_len(self) -> float | None:
        return self.emitted / self.steps if self.steps else None


class PlainDecoder:
    """One target forward per token."""

    def __init__(self, model, sampler: Sampler, prefetch: Prefetch):
        self.model, self.sampler, self.prefetch = model, sampler, prefetch
        self.installed = ExitStack()  # what `open_decoder` installed on the model for this run

    @property
    def reads_history(self) -> bool:
        return self.sampler.reads_history

    def step(
        self,
        history: torch.Tensor | None,
        kv_cache: Cache,
        wanted: int | None = None,
        last: int | None = None,
    ) -> list[int]:
        self.prefetch.begin_step()
        try:
            logits = self.model.decode(int(history[-1]) if last is None else last, kv_cache)
        finally:
            self.prefetch.end_step()
        return [self.sampler.sample(logits, history)]

    def summary(self) -> SpecSummary:
        return SpecSummary(prefetch=self.prefetch.description)

    def close(self) -> None:
        self.prefetch.close(self.model)
        self.installed.close()


class SpeculativeDecoder:
    """Draft γ tokens, verify them in one target forward, keep the accepted prefix."""

    def __init__(
        self,
        model,
        drafter: Drafter,
        sampler: Sampler,
        spec: SpecConfig,
        prefetch: Prefetch,
        length: DraftLengthController,
    ):
        self.model, self.drafter, self.sampler = model, drafter, sampler
        self.spec, self.prefetch, self.length = spec, prefetch, length
        self.plain = PlainDecoder(model, sampler, prefetch)  # for a step with nothing worth drafting
        self.counters = SpecCounters()
        self.installed = ExitStack()
        self.reads_history = True  # its drafter and verification do

    def step(
        self, history: torch.Tensor, kv_cache: Cache, wanted: int | None = None, last: int | None = None
    ) -> list[int]:
        draft_len = self.length.draft_len
        if wanted is not None:  # a verify emits up to γ + 1 tokens: draft none the caller cannot use
            draft_len = min(draft_len, wanted - 1)
        if draft_len < 1:  # one token left: a draft would only cost time
            return self.plain.step(history, kv_cache, last=last)
        saved = RecurrentState.save(kv_cache)  # linear-attention/Mamba state: restored, not cropped
        verdict: Verdict | None = None
        draft = None
        self.prefetch.begin_step(verify_tokens=draft_len + 1)
        try:
            started = time.perf_counter()
            draft = self._draft(history, kv_cache, draft_len, saved)
            drafted = time.perf_counter()
            target_probs = self._verify(history, draft.tokens, kv_cache)
            verdict = self._accept(draft, target_probs)
            self._count(draft.tokens, verdict, drafted - started, time.perf_counter() - drafted)
            self._tune_cutoff(len(draft.tokens), drafted - started)
            # α is the acceptance of confident draft tokens: the unsure one that ended a draft is
            # the confidence rule's business, and counting it would shorten every later draft
            self.length.update(min(verdict.accepted, draft.confident), draft.confident)
        finally:
            # the accepted tokens and the correction or bonus one, all but the newest in the cache;
            # after a failure, back to where the step began
            accepted = draft.tokens[: verdict.accepted] if verdict is not None and draft is not None else None
            self._rewind(kv_cache, history, accepted, saved)
            self.prefetch.end_step()
        return list(verdict.tokens)

    def _rewind(
        self, kv_cache: DynamicCache, history: torch.Tensor, accepted: list[int] | None, saved
    ) -> None:
        """Both caches keep the committed tokens, and the last one and the `accepted` draft tokens
        after a verify (mlx-lm's `_rewind_cache`). A recurrent state cannot be cropped: it goes
        back to the step's start (`saved`) and the kept tokens are fed again."""
        committed = len(history) - 1
        kept = committed if accepted is None else committed + len(accepted) + 1
        if saved is not None and kv_cache.get_seq_length() > kept:
            rewind_cache(kv_cache, committed, saved)
            if accepted is not None:
                with self.model.cache.in_phase("verify"):
                    self.model.forward(torch.cat([history[-1:], history.new_tensor(accepted)]), kv_cache)
        else:
            rewind_cache(kv_cache, kept)
        self.drafter.rewind(kept)

    def _tune_cutoff(self, drafted: int, draft_s: float) -> None:
        """SP-MoE 4.2.1, when no cutoff was given: the deepest layer whose predicted experts both
        fit the cache beside one layer's verify and copy within the draft's measured time."""
        predictor = self.prefetch.predictor
        if not isinstance(predictor, SpMoePredictor) or self.prefetch.manual_cutoff or not drafted:
            return
        model = self.model
        per_layer = unique_experts(model.store.num_experts, model.top_k, drafted + 1)
        cached_fraction = model.cache.n_slots / model.store.total_experts
        to_copy = per_layer * (1 - cached_fraction)
        if predictor.spare_only:  # a streaming cache: prefetches go into its spare slots alone
            free_slots = STREAM_DEPTH
            to_copy = min(to_copy, free_slots)  # the first layer fills them
        else:  # whatever one layer's verify does not pin
            free_slots = max(model.cache.n_slots - per_layer, 0)
        inputs = CutoffInputs(
            moe_layers=len(predictor.layers),
            experts_per_layer=to_copy,
            expert_nbytes=model.store.expert_nbytes,
            free_nbytes=int(free_slots * model.store.expert_nbytes),
            t_load_ms=self.prefetch.load_ms(model),
            draft_ms=draft_s * 1e3,
        )
        choice = choose_cutoff(inputs)
        if choice.layer != predictor.cutoff:
            log.info("SP-MoE cutoff layer %d: %s", choice.layer, choice.reason)
        predictor.cutoff = choice.layer
        self.prefetch.description = (
            f"spmoe (cutoff {choice.layer} of {len(predictor.layers)} MoE layers, auto)"
        )

    def _draft(self, history: torch.Tensor, kv_cache: DynamicCache, draft_len: int, saved):
        """The drafter's proposal; its expert uses and prefetches count as the draft's. A
        self-drafter's entries in the target's cache are approximate: verification recomputes them
        from the step's start (its recurrent state `saved` included)."""
        committed = kv_cache.get_seq_length()
        try:
            with self.model.cache.in_phase("draft"):
                return self.drafter.propose(history, draft_len, kv_cache)
        finally:
            rewind_cache(kv_cache, committed, saved)

    def _verify(self, history: torch.Tensor, draft: list[int], kv_cache: DynamicCache) -> torch.Tensor:
        """Target distributions `[γ+1, V]` after the last committed token and after each draft token
        (greedy: the scores whose argmax `greedy_accept` takes)."""
        with self.model.cache.in_phase("verify"):
            ids = torch.cat([history[-1:], history.new_tensor(draft)])
            logits = self.model.forward(ids, kv_cache, logits_to_keep=0)  # [γ+1, V]
        context = torch.cat([history, history.new_tensor(draft)])
        committed = len(history)
        if self.sampler.config.is_greedy:  # `greedy_accept` takes their argmax: no one-hot rows made
            return self.sampler.greedy_scores(logits, context, committed)
        rows = [self.sampler.probs(logits[i], context[: committed + i]) for i in range(len(draft) + 1)]
        return torch.stack(rows)  # [γ+1, V]

    def _accept(self, draft, target_probs: torch.Tensor) -> Verdict:
        if self.sampler.config.is_greedy:
            return greedy_accept(draft.tokens, target_probs)  # rows are scores: their argmax
        if self.spec.lossless:
            return rejection_accept(draft.tokens, draft.probs, target_probs, self.sampler.generator)
        return adaptive_accept(
            draft.tokens,
            draft.probs,
            target_probs,
            self.spec.adaptive_tau,
            self.spec.adaptive_tolerance,
            self.sampler.generator,
        )

    def _count(self, draft: list[int], verdict: Verdict, draft_s: float, verify_s: float) -> None:
        c = self.counters
        c.steps += 1
        c.drafted += len(draft)
        c.accepted += verdict.accepted
        c.emitted += len(verdict.tokens)
        c.draft_s += draft_s
        c.verify_s += verify_s

    def summary(self) -> SpecSummary:
        c = self.counters
        return SpecSummary(
            spec=self.drafter.name,
            prefetch=self.prefetch.description,
            lossless=self.spec.lossless,
            verify_steps=c.steps,
            drafted_tokens=c.drafted,
            accepted_tokens=c.accepted,
            emitted_tokens=c.emitted,
            draft_ms=c.draft_s * 1e3,
            verify_ms=c.verify_s * 1e3,
        )

    def close(self) -> None:
        self.prefetch.close(self.model)
        self.installed.close()
        self.drafter.close()


def open_decoder(
    model,
    spec: SpecConfig,
    prefetch_policy: str,
    cutoff: int | None,
    sampler: Sampler,
    cpu_experts: str = "never",
):
    """The decoder for one run, with its drafter, prefetch policy and CPU execution installed on `model`.

    `auto` speculation or prefetch is resolved for `model` first (`engine.speculative.auto`)."""
    spec.validate()
    chosen = resolve_auto(model, spec, prefetch_policy, cutoff)
    spec, prefetch_policy, cutoff = chosen.spec, chosen.prefetch, chosen.cutoff
    hybrid = HybridExecutor(model, cpu_experts) if cpu_experts != "never" else None  # validates the mode
    decoder = _build_decoder(model, spec, prefetch_policy, cutoff, sampler)
    decoder.installed.enter_context(model.control.installed(hybrid=hybrid))  # once nothing else can fail
    return decoder


def _build_decoder(model, spec: SpecConfig, prefetch_policy: str, cutoff: int | None, sampler: Sampler):
    if spec.mode == "none":
        return PlainDecoder(model, sampler, install_prefetch(model, prefetch_policy, cutoff=cutoff))
    draft_sampler = Sampler(_draft_sampling(sampler.config), model.device, sampler.prompt_tokens)
    drafter = make_drafter(model, spec, draft_sampler)
    # SP-MoE routes a separate draft's (or the MTP layer's) residual stream through the target's routers
    draft_model = drafter.model if isinstance(drafter, ModelDrafter | MtpDrafter) else None
    prefetch = install_prefetch(
        model, prefetch_policy, cutoff=cutoff, speculative=True, draft_model=draft_model
    )
    return SpeculativeDecoder(model, drafter, sampler, spec, prefetch, _draft_length(model, spec, sampler))


def _draft_length(model, spec: SpecConfig, sampler: Sampler) -> DraftLengthController:
    """The model's draft-length controller for this setting, made at its first use.

    How often a drafter's tokens are accepted is mostly a property of the draft and target pair,
    so every reply with the same setting (and the same greedy-or-sampling rule) goes on from the
    acceptance the previous ones measured rather than from the prior; the controller's decay
    still follows a conversation that drafts better or worse. A seeded sampling request starts
    from the prior instead: its random draws depend on the draft lengths, and the same seed
    must give the same reply.
    """
    greedy = sampler.config.is_greedy
    if not greedy and sampler.config.seed is not None:
        return _new_draft_length(spec)
    key = (spec, greedy)
    if key not in model.draft_lengths:
        model.draft_lengths[key] = _new_draft_length(spec)
    return model.draft_lengths[key]


def _new_draft_length(spec: SpecConfig) -> DraftLengthController:
    return DraftLengthController(spec.draft_len, max_len=spec.max_draft_len, adapt=spec.adapt_draft_len)


def _draft_sampling(config: SamplingConfig) -> SamplingConfig:
    """The draft samples as the target does, from its own generator (seeded apart when seeded)."""
    return replace(config, seed=derived_seed(config.seed, 1))  # wraps: 2**63 - 1 gives 0


def make_drafter(model, spec: SpecConfig, sampler: Sampler) -> Drafter:
    tau = spec.confidence_tau
    if spec.mode == "draft":
        return ModelDrafter(model, spec.draft_model, sampler, tau)
    if spec.mode == "mtp":
        return MtpDrafter(model, sampler, tau)
    if spec.mode == "self":
        return SelfDrafter(model, sampler, spec.top_r, spec.cached_only, tau)
    return SubstituteDrafter(model, model.substitutes(spec.substitute_bits), sampler, tau)
