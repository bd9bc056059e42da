"""The stored auto-tune result for a loaded model, as the `auto` defaults use it.

`stored_choice(model)` looks the model up in the tune store under the key
`engine.tune.run.tune` files its result under (GPU, model, cache budget, expert
precision) without measuring anything, and returns what it chose (drafter, draft length,
cutoff layer, prefetch, cache policy, CPU execution of misses), or None when this model was
never tuned on this machine with this budget. `tuned_config(model, config)` is a request's
config with its `auto` choices resolved from it, the chosen cache policy put in place
(`apply_policy`) where the model was loaded with the default one.
"""

from __future__ import annotations

import logging

import torch

from engine.config import OffloadConfig
from engine.generation_config import GenerationConfig
from engine.speculative.auto import TunedChoice, resolve_config
from engine.tune.store import TuneStore, model_fingerprint, tune_key

log = logging.getLogger(__name__)
DEFAULT_POLICY = OffloadConfig().policy


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
    c = result.choice
    log.info("auto: the stored tune result: cutoff layer %d, draft length %d", c.cutoff_layer, c.draft_len)
    return TunedChoice(c.cutoff_layer, c.draft_len, c.drafter, c.prefetch, c.policy, c.cpu_experts)


def tuned_config(model, config: GenerationConfig, store: TuneStore | None = None) -> GenerationConfig:
    """`config` with its `auto` speculation and prefetch resolved for `model` from its stored tune
    result where there is one (whose cache policy is then put in place: `apply_policy`)."""
    choice = stored_choice(model, store)
    if choice is not None and model.config.policy == DEFAULT_POLICY:  # a policy asked for stays
        apply_policy(model, choice.policy)
    return resolve_config(model, config, choice)


def apply_policy(model, policy: str) -> None:
    """The expert cache under the cache policy `policy` ("" leaves it); changing it empties the
    cache, so a policy already in place is kept as it is."""
    if policy and policy != model.cache.policy.name:
        log.info("auto: the stored auto-tune result sets the %s cache policy", policy.upper())
        model.use_cache_policy(policy)


def _gpu_uuid(device: torch.device) -> str | None:
    """The GPU's UUID as the hardware probe writes it ("GPU-…"); None on a CPU device."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
