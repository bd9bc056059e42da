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


def describe_choice(choice: dict[str, Any], applied: AppSettings | None = None) -> str:
    """The chosen settings as rich text: what Apply sets when `applied` is given (the one source of
    the summary), else the choice itself; then how sure the measurement is."""
    cutoff = int(choice.get("cutoff_layer", -1))
    draft_len = int(choice.get("draft_len", 0))
    drafter = choice.get("drafter", "")
    prefetch, policy = choice.get("prefetch", ""), choice.get("policy", "")
    if applied is not None:
        draft_len = 0 if applied.spec_mode == "none" else applied.draft_len
        drafter = applied.spec_mode if applied.spec_mode in _DRAFTERS else "draft"
        cutoff = (
            applied.cutoff_layer if applied.prefetch == "spmoe" and applied.cutoff_layer is not None else -1
        )
        prefetch, policy = ("next-layer" if applied.prefetch == "next-layer" else ""), applied.policy
    cutoff_text = (
        "none (no prefetch)" if cutoff < 0 else f"{cutoff} (SP-MoE prefetch for MoE layers 0–{cutoff})"
    )
    if prefetch == "next-layer":
        cutoff_text = "next-layer prefetch"
    draft_text = "0 (plain decoding, no speculation)" if draft_len == 0 else str(draft_len)
    drafter_text = f" with {_DRAFTERS.get(drafter, drafter)}" if draft_len and drafter else ""
    policy_text = f" ({policy.upper()})" if policy else ""
    notes = [text for text in (choice.get("certainty", ""), choice.get("why", "")) if text]
    return (
        f"<b>Chosen:</b> draft length {draft_text}{drafter_text} · cutoff layer {cutoff_text} · "
        f"{choice.get('cache_experts', '?')} cached experts{policy_text} · "
        f"<b>expected {float(choice.get('expected_tokens_per_s', 0.0)):.1f} tokens/s</b>"
        + "".join(f"<br>{html.escape(text)}" for text in notes)
    )


def describe_probe(probe: dict[str, Any]) -> str:
    """The probe in one line: the GPU and its PCIe link, or the simulated link."""
    link = f"{probe.get('h2d_gbps', 0.0):.3g} GB/s host→device"
    if probe.get("simulated_link") or probe.get("device_kind") == "cpu":
        return f"Machine: CPU, simulated link of {link}. {probe.get('note', '')}".strip()
    pcie = ""
    if probe.get("pcie_gen_current") is not None:
        pcie = f", PCIe {probe['pcie_gen_current']}.0 x{probe.get('pcie_width_current') or '?'}"
    return f"Machine: {probe.get('gpu_name') or 'GPU'}, {gib(probe.get('vram_total_bytes'))}{pcie}, {link}."
