"""Generation metrics, named as in DESIGN.md.

- `tpot_ms`: decode wall time / tokens produced by decode steps (prefill excluded).
- `tokens_per_s`: 1000 / tpot_ms; `prefill_tokens_per_s` separately.
- `hit_rate`: expert uses served from the device cache / all expert uses, per phase.
- `h2d_gbps`: bytes the engine copied host→device / wall time (counted, not sampled).

Every figure carries `simulated_link`: on a machine without a GPU the link is
simulated, and so is anything timed over it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.expert_cache import ExpertCache, PhaseCounters

Snapshot = dict[str, PhaseCounters]


def cache_snapshot(cache: ExpertCache) -> Snapshot:
    return {phase: PhaseCounters(**asdict(c)) for phase, c in cache.stats.phases.items()}


def phase_delta(before: Snapshot, after: Snapshot, phase: str) -> PhaseCounters:
    a, b = after.get(phase, PhaseCounters()), before.get(phase, PhaseCounters())
    return PhaseCounters(
        hits=a.hits - b.hits,
        misses=a.misses - b.misses,
        bytes_copied=a.bytes_copied - b.bytes_copied,
        copies=a.copies - b.copies,
    )


@dataclass(frozen=True)
class PhaseStats:
    hits: int
    misses: int
    h2d_bytes: int
    hit_rate: float | None

    @classmethod
    def of(cls, counters: PhaseCounters) -> PhaseStats:
        return cls(counters.hits, counters.misses, counters.bytes_copied, counters.hit_rate)


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
    bytes_per_token: float | None  # decode-phase bytes copied per generated token
    simulated_link: bool
    prefill: PhaseStats
    decode: PhaseStats

    @classmethod
    def build(
        cls,
        *,
        prompt_tokens: int,
        generated_tokens: int,
        prefill_s: float,
        decode_s: float,
        prefill: PhaseCounters,
        decode: PhaseCounters,
        simulated_link: bool,
    ) -> GenerationStats:
        decode_steps = generated_tokens - 1  # the first token comes from the prefill's logits
        tpot_ms = decode_s * 1e3 / decode_steps if decode_steps > 0 else None
        total = PhaseCounters(
            hits=prefill.hits + decode.hits,
            misses=prefill.misses + decode.misses,
            bytes_copied=prefill.bytes_copied + decode.bytes_copied,
            copies=prefill.copies + decode.copies,
        )
        wall = prefill_s + decode_s
        return cls(
            prompt_tokens=prompt_tokens,
            generated_tokens=generated_tokens,
            prefill_ms=prefill_s * 1e3,
            decode_ms=decode_s * 1e3,
            tpot_ms=tpot_ms,
            tokens_per_s=1e3 / tpot_ms if tpot_ms else None,
            prefill_tokens_per_s=prompt_tokens / prefill_s if prefill_s > 0 else None,
            hits=total.hits,
            misses=total.misses,
            hit_rate=total.hit_rate,
            h2d_bytes=total.bytes_copied,
            h2d_gbps=total.bytes_copied / wall / 1e9 if wall > 0 else None,
            bytes_per_token=decode.bytes_copied / decode_steps if decode_steps > 0 else None,
            simulated_link=simulated_link,
            prefill=PhaseStats.of(prefill),
            decode=PhaseStats.of(decode),
        )

    def to_dict(self) -> dict:
        return asdict(self)
