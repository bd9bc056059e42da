"""Calling a transformers model across the 5.x releases' renames.

transformers 5.24 renamed a model's `forward(past_key_values=…)` to `forward(cache=…)` and warns on
the old name (removed in 5.40); earlier 5.x releases know only the old one. `with_cache` names the
KV cache the way the installed release expects, looked up once per model class.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch


@cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def with_cache(model: torch.nn.Module, kv_cache, **kwargs) -> dict:
    """`kwargs` for `model(**…)` plus the KV cache under the name this transformers expects."""
    return {_cache_keyword(type(model)): kv_cache, **kwargs}


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder of a transformers causal LM (the module holding `layers`): `get_decoder()`,
    except where that returns the model itself because its class's `base_model_prefix` names no
    attribute of it (Llama4ForCausalLM: `language_model`, its decoder being `model`)."""
    found = model.get_decoder()
    if found is model and isinstance(getattr(model, "model", None), torch.nn.Module):
        return model.model
    return found
