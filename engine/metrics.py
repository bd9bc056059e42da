"""Generation metrics, named as in DESIGN.md.

- `tpot_ms`: decode wall time / tokens produced by decode steps (prefill excluded).
- `tokens_per_s`: 1000 / tpot_ms; `prefill_tokens_per_s` separately.
- `hit_rate`: expert uses served from the device cache / all expert uses, per phase.
- `accept_len`: mean tokens emitted per verify step (the bonus token included).
- `prefetch_precision`: prefetched experts used before leaving the cache / prefetched.
- `prefetch_recall`: verify-phase uses that were a prefetched expert's first use / verify uses.
- `h2d_gbps`: bytes the engine copied host→device / wall time (counted, not sampled).

Every figure carries `simulated_link`: on a machine without a GPU the link is
simulated, and so is anything timed over it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from engine.decode.paths import StepLog
from engine.device_cache.expert_cache import ExpertCache
from engine.device_cache.stats import PHASES, PhaseCounters

Snapshot = dict[str, PhaseCounters]


def cache_snapshot(cache: ExpertCache) -> Snapshot:
    return {phase: PhaseCounters(**asdict(c)) for phase, c in cache.stats.phases.items()}


def phase_delta(before: Snapshot, after: Snapshot, phase: str) -> PhaseCounters:
    a, b = after.get(phase, PhaseCounters()), before.get(phase, PhaseCounters())
    return PhaseCounters(**{f.name: getattr(a, f.name) - getattr(b, f.name) for f in fields(PhaseCounters)})


@dataclass(frozen=True)
class PhaseStats:
    hits: int
    misses: int
    h2d_bytes: int
    hit_rate: float | None
    prefetched: int  # experts this phase prefetched; each ends up used or wasted
    prefetch_used: int
    prefetch_wasted: int
    prefetch_hits: int

    @classmethod
    def of(cls, counters: PhaseCounters) -> PhaseStats:
        return cls(
            counters.hits,
            counters.misses,
            counters.bytes_copied,
            counters.hit_rate,
            counters.prefetched,
            counters.prefetch_used,
            counters.prefetch_wasted,
            counters.prefetch_hits,
        )


@dataclass(frozen=True)
class SpecSummary:
    """What the decoder did: `spec` 'none' for plain decoding."""

    spec: str = "none"
    prefetch: str = "none"
    lossless: bool = True
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_ms: float
    decode_ms: float
    tpot_ms: float | None
    tokens_per_s: float | None
    prefill_tokens_per_s: float | None
    hits: int
    misses: int
    hit_rate: float | None
    h2d_bytes: int
    h2d_gbps: float | None
    bytes_per_token: float | None  # bytes copied after the prefill, per generated token
    simulated_link: bool
    spec: str
    prefetch: str
    lossless: bool  # False only with SS-MoE adaptive acceptance
    accept_len: float | None  # mean tokens emitted per verify step, bonus included
    acceptance_rate: float | None  # accepted draft tokens / drafted tokens
    draft_len: float | None  # mean draft tokens per verify step
    verify_steps: int
    prefetch_precision: float | None  # prefetched experts used before leaving the cache / prefetched
    prefetch_recall: float | None  # verify (plain: decode) uses that were a prefetch's first use / uses
    hit_rate_verify: float | None
    prefill: PhaseStats
    decode: PhaseStats
    draft: PhaseStats
    verify: PhaseStats
    cached_prompt_tokens: int = 0  # prompt tokens a kept KV cache held: not prefilled again
    # the decode-step path most of the run's steps took (engine.decode.paths), the steps each path
    # ran, and why each faster path left steps to a slower one
    step_path: str | None = None
    step_paths: dict[str, int] = field(default_factory=dict)
    step_path_declined: dict[str, str] = field(default_factory=dict)
    kernels: str = "exact"  # what computed the model on the CPU: "exact" (torch) or "ggml"
    draft_token_ms: float | None = None  # speculation: the drafter's time per draft token

    @classmethod
    def build(
        cls,
        *,
        prompt_tokens: int,
        generated_tokens: int,
        prefill_s: float,
        decode_s: float,
        phases: dict[str, PhaseCounters],
        simulated_link: bool,
        speculation: SpecSummary | None = None,
        cached_prompt_tokens: int = 0,
        step_paths: dict | None = None,
        kernels: str = "exact",
    ) -> GenerationStats:
        spec = speculation or SpecSummary()
        phase = {name: phases.get(name, PhaseCounters()) for name in PHASES}
        decode_steps = generated_tokens - 1  # the first token comes from the prefill's logits
        tpot_ms = decode_s * 1e3 / decode_steps if decode_steps > 0 else None
        total, after_prefill = PhaseCounters(), PhaseCounters()
        for name, counters in phase.items():
            total.add(counters)
            if name != "prefill":
                after_prefill.add(counters)
        wall = prefill_s + decode_s
        prefilled = prompt_tokens - cached_prompt_tokens  # a reused prefix is not prefilled again
        recall_phase = phase["verify"] if spec.spec != "none" else phase["decode"]
        return cls(
            prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens,
            prefill_ms=prefill_s * 1e3,
            decode_ms=decode_s * 1e3,
            tpot_ms=tpot_ms,
            tokens_per_s=1e3 / tpot_ms if tpot_ms else None,
            prefill_tokens_per_s=prefilled / prefill_s if prefill_s > 0 else None,
            hits=total.hits,
            misses=total.misses,
            hit_rate=total.hit_rate,
            h2d_bytes=total.bytes_copied,
            h2d_gbps=total.bytes_copied / wall / 1e9 if wall > 0 else None,
            bytes_per_token=after_prefill.bytes_copied / decode_steps if decode_steps > 0 else None,
            simulated_link=simulated_link,
            spec=spec.spec,
            prefetch=spec.prefetch,
            lossless=spec.lossless,
            accept_len=spec.emitted_tokens / spec.verify_steps if spec.verify_steps else None,
            acceptance_rate=spec.accepted_tokens / spec.drafted_tokens if spec.drafted_tokens else None,
            draft_len=spec.drafted_tokens / spec.verify_steps if spec.verify_steps else None,
            verify_steps=spec.verify_steps,
            prefetch_precision=total.prefetch_used / total.prefetched if total.prefetched else None,
            prefetch_recall=recall_phase.prefetch_hits / recall_phase.uses if recall_phase.uses else None,
            hit_rate_verify=phase["verify"].hit_rate,
            prefill=PhaseStats.of(phase["prefill"]),
            decode=PhaseStats.of(phase["decode"]),
            draft=PhaseStats.of(phase["draft"]),
            verify=PhaseStats.of(phase["verify"]),
            cached_prompt_tokens=cached_prompt_tokens,
            **(step_paths or {}),
            kernels=kernels,
            draft_token_ms=spec.draft_ms / spec.drafted_tokens if spec.drafted_tokens else None,
        )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LiveGeneration:
    """What a running `generate()` shares with a telemetry thread, which only reads it.

    `generate` fills it as it goes; `stats(now)` builds the same `GenerationStats` the run will
    end with, from the counters so far."""

    started: float
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # held by a reused KV cache
    prefilled: float | None = None  # perf_counter when the prefill ended
    generated: int = 0
    finished: float | None = None
    before: Snapshot | None = None  # the cache's counters when the run began
    decoder: Any = None  # PlainDecoder | SpeculativeDecoder once built
    steps: StepLog | None = None  # the model's decode-step paths' log
    steps_before: Any = None  # its snapshot when the run began
    kernels: str = "exact"  # the model's (`OffloadConfig.kernels`, resolved at load)

    def stats(self, cache: ExpertCache, now: float, simulated_link: bool) -> GenerationStats:
        end = self.finished or now
        prefilled = self.prefilled or end
        after = cache_snapshot(cache)
        before = self.before if self.before is not None else after  # an empty snapshot is a real one
        return GenerationStats.build(
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated,
            prefill_s=prefilled - self.started,
            decode_s=end - prefilled,
            phases={p: phase_delta(before, after, p) for p in PHASES},
            simulated_link=simulated_link,
            speculation=self.decoder.summary() if self.decoder is not None else None,
            cached_prompt_tokens=self.cached_prompt_tokens,
            step_paths=self.steps.since(self.steps_before) if self.steps is not None else None,
            kernels=self.kernels,
        )
