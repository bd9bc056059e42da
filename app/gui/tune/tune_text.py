"""The auto-tune result in words: the chosen settings (as Apply sets them) and the probed machine.

Pure functions of the `TuneResult` dict and the settings, so the wizard's summary and the
settings it applies come from one place and can be tested without a window.
"""

from __future__ import annotations

import html
from typing import Any

from app.settings import AppSettings


def gib(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / 2**30:.1f} GiB"


_DRAFTERS = {
    "draft": "the draft model",
    "self": "self-speculation",
    "substitute": "substitute experts",
    "mtp": "the model's MTP layer",
}


def describe_choice(choice: dict[str, Any]) -> str:
    """The tuned choice for the loaded model as rich text, then how sure the measurement is and why
    the winner won."""
    cutoff = int(choice.get("cutoff_layer", -1))
    draft_len = int(choice.get("draft_len", 0))
    drafter = choice.get("drafter", "")
    cutoff_text = (
        "none (no prefetch)" if cutoff < 0 else f"{cutoff} (SP-MoE prefetch for MoE layers 0–{cutoff})"
    )
    if choice.get("prefetch") == "next-layer":
        cutoff_text = "next-layer prefetch"
    draft_text = "0 (plain decoding, no speculation)" if draft_len == 0 else str(draft_len)
    drafter_text = f" with {_DRAFTERS.get(drafter, drafter)}" if draft_len and drafter else ""
    policy = choice.get("policy", "")
    policy_text = f" ({policy.upper()})" if policy else ""
    notes = [text for text in (choice.get("certainty", ""), choice.get("why", "")) if text]
    return (
        f"<b>Chosen for this model:</b> draft length {draft_text}{drafter_text} · cutoff layer "
        f"{cutoff_text} · {choice.get('cache_experts', '?')} cached experts{policy_text} · "
        f"<b>expected {float(choice.get('expected_tokens_per_s', 0.0)):.1f} tokens/s</b>"
        + "".join(f"<br>{html.escape(text)}" for text in notes)
    )


_FIELD_WORDS = {"spec_mode": "speculation", "prefetch": "prefetch", "cutoff_layer": "the cutoff layer"}


def describe_apply(settings: AppSettings, use_auto: bool, budget: str | None = None) -> str:
    """What Apply changes in the settings, said before it does: a tune result belongs to its model
    (and GPU, budget, precision) and runs as that model's `auto`; settings that fix speculation or
    prefetch for every model change only when the user ticks the box (`use_auto`); `budget`: a
    new expert budget typed on page 2."""
    fixed = settings.tune_blockers()
    named = ", ".join(f"{_FIELD_WORDS[name]} ({value})" for name, value in fixed.items())
    if not fixed:
        text = (
            "Apply changes none of your settings: from the next reply this model runs the choice "
            "above as its auto; other models keep their own tuning, or the defaults."
        )
    elif use_auto:
        text = (
            f"Apply sets {named} to auto, for every model: each then runs its own tuned choice, "
            "or the defaults. Nothing else changes."
        )
    else:
        text = (
            f"Your settings fix {named} for every model, so the choice above does not run. Tick the "
            "box to leave them to each model's auto; Apply leaves them as they are otherwise."
        )
    if budget is not None:
        text += f" The expert budget becomes {budget} and the model reloads: tune again after it."
    return text


def describe_probe(probe: dict[str, Any]) -> str:
    """The probe in one line: the GPU and its PCIe link, or the simulated link."""
    link = f"{probe.get('h2d_gbps', 0.0):.3g} GB/s host→device"
    if probe.get("simulated_link") or probe.get("device_kind") == "cpu":
        return f"Machine: CPU, simulated link of {link}. {probe.get('note', '')}".strip()
    pcie = ""
    if probe.get("pcie_gen_current") is not None:
        pcie = f", PCIe {probe['pcie_gen_current']}.0 x{probe.get('pcie_width_current') or '?'}"
    return f"Machine: {probe.get('gpu_name') or 'GPU'}, {gib(probe.get('vram_total_bytes'))}{pcie}, {link}."
