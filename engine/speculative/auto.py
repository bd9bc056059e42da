"""What `auto` speculation and prefetch mean for one model: the engine's defaults.

Every front-end asks for `auto` when the user chose nothing, and the decoder
resolves it here, against the loaded model:

- speculation: the draft model given, else the checkpoint's own MTP layer (`mtp`:
  DeepSeek-V3, GLM-4.5, Qwen3.5/3.6 and Qwen3-Next ship one), else the model's bundled
  draft (the demo's), else the target itself with fewer experts per token (SS-MoE `self`), else none
  (a model routing each token to one expert cannot draft with fewer, and one whose experts are all
  used in place, with no link, gains nothing from self-drafting);
- prefetch: SP-MoE from that draft, or none when nothing drafts (SP-MoE predicts
  from the draft's hidden states);
- a stored auto-tune result (`TunedChoice`, looked up by the caller: the tune room
  sits above this one) gives the drafter, the draft length, the cutoff layer or next-layer
  prefetch, and CPU execution of misses where asked for as `auto`, or turns speculation and
  SP-MoE off where it measured plain decoding fastest.

Each choice that falls back says why in one log line. Settings that are not
`auto` pass through unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from engine.errors import InvalidRequestError
from engine.generation_config import AUTO, GenerationConfig, SpecConfig
from engine.model.adapters.families import NO_SPECULATION
from engine.resources import demo_draft_dir, demo_model_dir
from engine.speculative.mtp import has_mtp_layer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TunedChoice:
    """What a stored auto-tune result chose for this model, budget and machine."""

    cutoff_layer: int  # last MoE layer SP-MoE prefetches; -1: none
    draft_len: int  # 0: plain decoding measured fastest
    drafter: str = ""  # measured fastest: "draft", "self", "substitute", "mtp"; "": not recorded
    prefetch: str = ""  # "next-layer" where that measured fastest; "": SP-MoE to the cutoff
    policy: str = ""  # the cache policy measured fastest (engine.worker.tuned applies it)
    cpu_experts: str = ""  # "auto" where computing misses on the CPU measured faster


@dataclass(frozen=True)
class Resolved:
    """The concrete speculation, prefetch and cutoff, and why they differ from the first choice."""

    spec: SpecConfig
    prefetch: str
    cutoff: int | None
    reasons: tuple[str, ...] = ()


def resolve(
    model, spec: SpecConfig, prefetch: str, cutoff: int | None, tuned: TunedChoice | None = None
) -> Resolved:
    """`spec`, `prefetch` and `cutoff` with every `auto` replaced by what suits `model`."""
    reasons: list[str] = []
    refuse_speculation_that_cannot_rewind(model, spec.mode)
    blocked = NO_SPECULATION.get(getattr(getattr(model, "arch", None), "model_type", ""))
    if blocked and spec.mode == AUTO:
        reasons.append(f"no speculation: {blocked}")
        spec = replace(spec, mode="none")
    if spec.mode == AUTO:
        spec = _auto_spec(model, spec, tuned, reasons)
    if prefetch == AUTO:
        prefetch, cutoff = _auto_prefetch(spec, cutoff, tuned, reasons)
    for reason in reasons:
        log.info("auto: %s", reason)
    return Resolved(spec, prefetch, cutoff, tuple(reasons))


def refuse_speculation_that_cannot_rewind(model, mode: str) -> None:
    """An explicit drafter on a family whose state speculation cannot rewind yet: a clear error."""
    blocked = NO_SPECULATION.get(getattr(getattr(model, "arch", None), "model_type", ""))
    if blocked and mode not in (AUTO, "none"):
        raise InvalidRequestError(
            f"Speculative decoding ({mode}) cannot run on this model yet: {blocked}. Use --spec none."
        )


def resolve_config(model, config: GenerationConfig, tuned: TunedChoice | None = None) -> GenerationConfig:
    """`config` with its `auto` speculation and prefetch resolved for `model`."""
    chosen = resolve(model, config.spec, config.prefetch, config.cutoff, tuned)
    config = replace(config, spec=chosen.spec, prefetch=chosen.prefetch, cutoff=chosen.cutoff)
    if tuned is not None and tuned.cpu_experts and config.cpu_experts == AUTO:
        config = replace(config, cpu_experts=tuned.cpu_experts)
    return config


def bundled_draft(model) -> str | None:
    """The draft model shipped with `model` (the demo's), or None."""
    try:
        if Path(model.path).resolve() == demo_model_dir().resolve():
            return str(demo_draft_dir())
    except OSError:  # no resources folder: no bundled draft either
        return None
    return None


def _auto_spec(model, spec: SpecConfig, tuned: TunedChoice | None, reasons: list[str]) -> SpecConfig:
    if tuned is not None and tuned.draft_len <= 0:
        reasons.append("the stored auto-tune result measured plain decoding fastest: no speculation")
        return replace(spec, mode="none")
    if tuned is not None:
        spec = replace(spec, draft_len=min(tuned.draft_len, spec.max_draft_len))
    draft = spec.draft_model or bundled_draft(model)
    top_k = getattr(model, "top_k", 1)
    if not spec.draft_model and tuned is not None and tuned.drafter in ("self", "substitute") and top_k >= 2:
        reasons.append(f"the stored auto-tune result measured {tuned.drafter}-drafting fastest")
        return replace(spec, mode=tuned.drafter, top_r=min(spec.top_r, top_k - 1))
    if not spec.draft_model and (tuned is None or tuned.drafter in ("", "mtp")) and _has_mtp(model):
        reasons.append(
            f"{Path(model.path).name} carries a multi-token-prediction layer: drafting with it (mtp)"
        )
        return replace(spec, mode="mtp")
    if draft:
        return replace(spec, mode="draft", draft_model=draft)
    if 1 <= spec.top_r < top_k and _nothing_copied(model):
        reasons.append(
            f"no draft model for {Path(model.path).name}, and every expert is used where it lies in "
            "memory (no link whose copies drafting would hide): self-drafting only adds steps, no "
            "speculation"
        )
        return replace(spec, mode="none")
    if 1 <= spec.top_r < top_k:
        reasons.append(
            f"no draft model for {Path(model.path).name}: drafting with the model itself, "
            f"{spec.top_r} of its {top_k} experts per token (self)"
        )
        return replace(spec, mode="self")
    reasons.append(
        f"no draft model for {Path(model.path).name}, and self-drafting needs fewer experts per "
        f"token than the model's {top_k}: no speculation"
    )
    return replace(spec, mode="none")


def _nothing_copied(model) -> bool:
    """Whether no step ever copies an expert: the model computes every expert where the host store
    holds it (a CPU run with no link simulated), or its device cache has a slot for each
    (`ExpertCache.holds_all`, filled at load). A self-draft step then costs a decode step's
    attention and a verify its tokens' experts, with no copy to save, so self-drafting is slower
    than plain decoding there (llama.cpp finds the same on a GPU holding a whole A3B model)."""
    cache = getattr(model, "cache", None)
    return bool(getattr(cache, "in_place", False) or getattr(cache, "holds_all", False))


def _has_mtp(model) -> bool:
    return hasattr(model, "draft_models") and has_mtp_layer(model)


def _auto_prefetch(
    spec: SpecConfig, cutoff: int | None, tuned: TunedChoice | None, reasons: list[str]
) -> tuple[str, int | None]:
    if tuned is not None and tuned.prefetch == "next-layer":
        reasons.append("the stored auto-tune result measured next-layer prefetch fastest")
        return "next-layer", None
    if spec.mode in ("none", AUTO):
        reasons.append("SP-MoE predicts experts from the draft and nothing drafts: no prefetch")
        return "none", cutoff
    if cutoff is None and tuned is not None:
        if tuned.cutoff_layer < 0:
            reasons.append("the stored auto-tune result measured no prefetch fastest")
            return "none", None
        cutoff = tuned.cutoff_layer
    return "spmoe", cutoff
