"""SP-MoE's cutoff layer: how deep into the model speculative prefetch goes (SP-MoE 4.2.1).

Contract: pure arithmetic on measured numbers. While the draft runs, the experts the verify
step will need are predicted and copied for the MoE layers 0..L (0-based, in model order);
L = -1 means no prefetch. L is the largest layer that satisfies both

    memory:  N_pref(L) · expert_nbytes <= free_nbytes   (free_nbytes = M_gpu - peak, or free slots)
    time:    N_pref(L) · t_load_ms     <= draft_ms      (copies hidden behind the whole draft)

with N_pref(L) = (L + 1) · experts_per_layer, the expected experts to prefetch per layer
(e.g. `unique_experts(E, K, γ) · (1 - hit_rate)`). Boundaries are inclusive up to float
rounding. `choose_cutoff` also says which constraint bound the choice, in words a user can
read; `resolve_cutoff` lets a manual setting override it, with its range checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

_ROUNDING = 1e-9  # relative slack so an exactly fitting layer is not lost to float error


@dataclass(frozen=True)
class CutoffInputs:
    """Measured numbers the cutoff rule needs."""

    moe_layers: int  # MoE layers in the target model
    experts_per_layer: float  # N_l: expected experts to prefetch per layer
    expert_nbytes: int  # bytes of one packed expert on the device
    free_nbytes: int  # device memory available to prefetched experts
    t_load_ms: float  # time to copy one expert host -> device
    draft_ms: float  # compute time of the whole drafting phase

    def __post_init__(self) -> None:
        if self.moe_layers < 1:
            raise ValueError(f"moe_layers must be >= 1, got {self.moe_layers}")
        if self.expert_nbytes < 1:
            raise ValueError(f"expert_nbytes must be >= 1, got {self.expert_nbytes}")
        for name in ("experts_per_layer", "free_nbytes", "t_load_ms", "draft_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True)
class CutoffChoice:
    """The cutoff layer and why; `by_memory` / `by_time` are None when nothing was measured."""

    layer: int  # last MoE layer (0-based) whose experts are prefetched; -1 = no prefetch
    by_memory: int | None  # largest layer the memory constraint allows
    by_time: int | None  # largest layer the time constraint allows
    reason: str


def choose_cutoff(inputs: CutoffInputs) -> CutoffChoice:
    """The largest L meeting both the memory and the time constraint (SP-MoE 4.2.1)."""
    per_layer = inputs.experts_per_layer
    by_memory = _largest_fitting(
        inputs.moe_layers, lambda layers: layers * per_layer * inputs.expert_nbytes, inputs.free_nbytes
    )
    by_time = _largest_fitting(
        inputs.moe_layers, lambda layers: layers * per_layer * inputs.t_load_ms, inputs.draft_ms
    )
    layer = min(by_memory, by_time)
    return CutoffChoice(layer, by_memory, by_time, _explain(inputs, layer, by_memory, by_time))


def resolve_cutoff(manual: int | None, inputs: CutoffInputs | None, moe_layers: int) -> CutoffChoice:
    """The manual cutoff when one is set (range-checked), else the measured choice.

    `inputs` may be None only with a manual cutoff; when given, the measured limits are
    reported beside the manual choice so a user sees what the measurements suggest.
    """
    if inputs is not None and inputs.moe_layers != moe_layers:
        raise ValueError(f"inputs describe {inputs.moe_layers} MoE layers but the model has {moe_layers}")
    measured = choose_cutoff(inputs) if inputs is not None else None
    if manual is None:
        if measured is None:
            raise ValueError("no cutoff layer set and no measurements to choose one from")
        return measured
    if isinstance(manual, bool) or not isinstance(manual, int) or not -1 <= manual < moe_layers:
        raise ValueError(
            f"cutoff layer must be an integer from -1 (no prefetch) to {moe_layers - 1} "
            f"(the last of the model's {moe_layers} MoE layers), got {manual!r}"
        )
    reason = f"Set by hand: {_span(manual, moe_layers)}."
    if measured is None:
        return CutoffChoice(manual, None, None, reason)
    reason += f" Measured choice: {measured.reason}"
    return CutoffChoice(manual, measured.by_memory, measured.by_time, reason)


def _largest_fitting(moe_layers: int, need: Callable[[int], float], limit: float) -> int:
    """Largest L in [-1, moe_layers - 1] with need(L + 1) <= limit; need grows with L."""
    layer = -1
    while layer + 1 < moe_layers and need(layer + 2) <= limit * (1 + _ROUNDING):
        layer += 1
    return layer


def _explain(inputs: CutoffInputs, layer: int, by_memory: int, by_time: int) -> str:
    """One or two sentences on which constraint set the cutoff."""
    last = inputs.moe_layers - 1
    if inputs.experts_per_layer == 0:
        return "No expert is expected to be missing, so every MoE layer is covered at no cost."
    span = _span(layer, inputs.moe_layers)
    if layer == last:
        return (
            f"{_sentence(span)}: their experts ({_size(_nbytes(inputs, layer))}) fit in the "
            f"{_size(inputs.free_nbytes)} free and load in {_ms(inputs, layer)} ms, "
            f"within the draft's {inputs.draft_ms:.1f} ms."
        )
    subject = "the first MoE layer alone" if layer < 0 else "one more layer"
    limits = []
    if by_memory == layer:
        limits.append(
            f"{subject} would need {_size(_nbytes(inputs, layer + 1))} of expert memory, "
            f"more than the {_size(inputs.free_nbytes)} free"
        )
    if by_time == layer:
        limits.append(
            f"{subject} would take {_ms(inputs, layer + 1)} ms of copies, "
            f"longer than the draft's {inputs.draft_ms:.1f} ms"
        )
    bound = "memory and time" if len(limits) == 2 else ("memory" if by_memory == layer else "time")
    return f"{_sentence(span)}, limited by {bound}: " + " and ".join(limits) + "."


def _span(layer: int, moe_layers: int) -> str:
    if layer < 0:
        return "no prefetch"
    if layer == 0:
        return f"prefetch for the first MoE layer only (1 of {moe_layers})"
    return f"prefetch for MoE layers 0–{layer} ({layer + 1} of {moe_layers})"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _nbytes(inputs: CutoffInputs, layer: int) -> float:
    """Expert bytes prefetched for layers 0..layer."""
    return (layer + 1) * inputs.experts_per_layer * inputs.expert_nbytes


def _ms(inputs: CutoffInputs, layer: int) -> str:
    return f"{(layer + 1) * inputs.experts_per_layer * inputs.t_load_ms:.1f}"


def _size(nbytes: float) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"
