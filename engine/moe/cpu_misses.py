"""Hybrid CPU execution of missing experts (Fiddler, HybriMoE): the measured costs and the layer plan.

Setting `cpu_experts`:

- `never`: every missing expert is copied to the device (the default on a CPU device).
- `always`: every missing expert is computed on the CPU straight from the host store.
- `auto`: per layer, `engine.moe.hybrid_schedule.schedule` (HybriMoE's simulation and priority rules)
  decides from a cost model measured on this machine at first use: expert compute on the
  device and on the CPU for a few token counts, and one expert's copy over the link.

On a CPU device the "device" *is* the CPU, so `auto` computes nothing "on the CPU" (there
would be nothing to gain, and simulated comparisons leave hybrid execution out); `always`
still computes misses from the host store without copying them, as a CPU-only run would.
A CPU-computed expert counts as a miss (it was not served by the device cache) and as
`cpu_computed`; it copies no bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from engine.errors import InvalidRequestError
from engine.generation_config import CPU_EXPERT_MODES
from engine.moe.hybrid_schedule import CostModel, schedule

log = logging.getLogger(__name__)

_SAMPLE_TOKENS = (1, 4, 16)


class HybridExecutor:
    """Chooses, per MoE layer call, which missing experts the CPU computes."""

    def __init__(self, model, mode: str):
        if mode not in CPU_EXPERT_MODES:
            raise InvalidRequestError(
                f"Unknown --cpu-experts {mode!r}; choose one of {', '.join(CPU_EXPERT_MODES)}."
            )
        self.model = model
        self.mode = mode
        self._cost: CostModel | None = None

    @property
    def active(self) -> bool:
        return self.mode == "always" or (self.mode == "auto" and self.model.device.type == "cuda")

    def cpu_experts(self, layer: int, routes: dict[int, list[int]]) -> list[int]:
        """Experts of this layer call to compute on the CPU (`routes`: expert → its token positions)."""
        cache = self.model.cache
        missing = [e for e in routes if (layer, e) not in cache]
        if not missing or not self.active:
            return []
        if self.mode == "always":
            return missing
        cached = {e for e in routes if (layer, e) in cache}
        plan = schedule({e: len(p) for e, p in routes.items()}, cached, self.cost_model(), "auto")
        return plan.cpu

    def cost_model(self) -> CostModel:
        if self._cost is None:
            self._cost = measure_cost_model(self.model)
            log.info("hybrid CPU execution cost model: %s", self._cost)
        return self._cost


def measure_cost_model(model) -> CostModel:
    """Expert compute on the device and on the CPU for a few token counts, and one expert's copy."""
    layer = model.store.layer_indices[0]
    experts = model.experts[layer]
    host_views = model.store.views(layer, 0)
    device_buffer = model.store.buffer(layer, 0).to(model.device)
    device_views = model.store.layout_of(layer).views(device_buffer)
    hidden = model.hf_config.hidden_size
    gpu, cpu = [], []
    for n in _SAMPLE_TOKENS:
        x_dev = torch.randn(n, hidden, dtype=model.dtype, device=model.device)
        x_cpu = x_dev.cpu()
        gpu.append((n, _time_ms(lambda x=x_dev: experts.expert_forward(x, device_views), model.device)))
        cpu.append((n, _time_ms(lambda x=x_cpu: experts.expert_forward(x, host_views), torch.device("cpu"))))
    load_ms = _time_ms(
        lambda: device_buffer.copy_(model.store.buffer(layer, 0), non_blocking=True), model.device
    )
    return CostModel.from_samples(gpu, cpu, load_ms)


def _time_ms(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    fn()  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / repeats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
