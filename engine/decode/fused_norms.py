"""RMS norms computed by torch's `F.rms_norm`: two to four kernels where transformers' eager
forward launches six to eight.

A decode step on a GPU with every expert resident is bound by kernel launches, not by the GPU:
a 48-layer Qwen3-MoE step runs 193 norms (four a layer: before attention and the MoE,
and the query and key norms, and the final one). Transformers' Llama-style `*RMSNorm.forward`
upcasts, squares, averages, adds epsilon, takes the root, scales, downcasts and multiplies by the
weight, one kernel each; `F.rms_norm` does the middle five as one fused kernel on CUDA. (On the
CPU torch 2.13 decomposes it into the same operators and more dispatches: the loader fuses the
norms on CUDA only.)

`fuse_rms_norms(model)` gives that forward to every module whose class is named `…RMSNorm`, whose
forward takes the hidden states alone, which has a `weight` of the normalised width and no other
parameter, and whose own forward gives the fused one's output bit for bit on a probe on the CPU,
in float32 and in bfloat16 (once per class): families whose norm differs — Gemma's `1 + weight`,
GPT-OSS's weight applied before the downcast, a gated or biased norm — fail the probe and keep
their own forward. On the CPU the outputs are therefore unchanged; on CUDA the fused kernel sums
the squares in its own order (float32 rounding, as the grouped experts' combine).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def fused_forward(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm: float32 normalisation, cast back, times the weight."""
    normed = F.rms_norm(hidden.float(), (hidden.shape[-1],), eps=_epsilon(module))
    return module.weight * normed.to(hidden.dtype)


def fuse_rms_norms(model: nn.Module) -> int:
    """Every norm of `model` that computes as `fused_forward` (see the module doc) switched to it.
    Returns how many were."""
    fused = 0
    for module in model.modules():
        if _fusable(type(module), module) and _same_on_probe(type(module), module.weight.shape[0]):
            module.forward = functools.partial(fused_forward, module)
            fused += 1
    return fused


def _epsilon(module: nn.Module) -> float | None:
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


def _fusable(cls: type, module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return (
        cls.__name__.endswith("RMSNorm")
        and len(inspect.signature(cls.forward).parameters) == 2  # (self, hidden): no gate, no residual
        and list(params) == ["weight"]
        and params["weight"].dim() == 1
        and not list(module.children())
        and isinstance(_epsilon(module), float)
    )


@functools.cache
def _same_on_probe(cls: type, width: int) -> bool:
    """Whether `cls`'s forward equals `fused_forward` bit for bit on the CPU (one probe per class)."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        module = _probe_module(cls, width, dtype, generator)
        if module is None:
            return False
        hidden = (torch.randn(4, width, generator=generator) * 3).to(dtype)
        with torch.no_grad():
            try:
                own = module(hidden)
            except Exception as err:  # another signature: not a plain norm
                log.debug("%s kept its own forward: %s", cls.__name__, err)
                return False
            if not isinstance(own, torch.Tensor) or not torch.equal(own, fused_forward(module, hidden)):
                return False
    return True


def _probe_module(cls: type, width: int, dtype: torch.dtype, generator: torch.Generator) -> nn.Module | None:
    """An instance of `cls` of `width` with a random weight, built the way the family builds it."""
    for args in ((width,), ((width,),)):
        try:
            module = cls(*args)
        except Exception:  # another constructor: try the next form
            continue
        if getattr(module, "weight", None) is not None and module.weight.shape == (width,):
            module = module.to(dtype)
            with torch.no_grad():
                module.weight.copy_(torch.randn(width, generator=generator) + 1)
            return module
    return None
