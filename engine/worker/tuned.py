"""The stored auto-tune result for a loaded model, as the `auto` defaults use it.

`stored_choice(model)` looks the model up in the tune store under the key
`engine.tune.run.tune` files its result under (GPU, model, cache budget, expert
precision) without measuring anything, and returns its cutoff layer and draft
length, or None when this model was never tuned on this machine with this budget.
"""

from __future__ import annotations

import logging

import torch

from engine.speculative.auto import TunedChoice
from engine.tune.store import TuneStore, model_fingerprint, tune_key

log = logging.getLogger(__name__)


def stored_choice(model, store: TuneStore | None = None) -> TunedChoice | None:
    """The stored tune result's choice for `model` as loaded now; None when there is none."""
    try:
        key = tune_key(
            _gpu_uuid(model.device),
            str(model.path),
            model_fingerprint(str(model.path)),
            str(model.cache.n_slots * model.store.expert_nbytes),
            model.info().expert_dtype,
        )
    except OSError as err:  # the model folder went away: nothing to look up
        log.info("No stored auto-tune result: %s", err)
        return None
    result = (store or TuneStore()).get(key)
    if result is None:
        return None
    choice = result.choice
    log.info(
        "auto: the stored auto-tune result sets cutoff layer %d, draft length %d",
        choice.cutoff_layer,
        choice.draft_len,
    )
    drafter = getattr(choice, "drafter", "")
    return TunedChoice(cutoff_layer=choice.cutoff_layer, draft_len=choice.draft_len, drafter=drafter)


def _gpu_uuid(device: torch.device) -> str | None:
    """The GPU's UUID as the hardware probe writes it ("GPU-…"); None on a CPU device."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
