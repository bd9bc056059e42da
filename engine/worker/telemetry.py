"""Live telemetry: the worker's `Stats` events, from the engine's own counters and the system's.

Counted figures (bytes copied, hits, misses, tokens) come from the engine and are
exact; NVML's sampled PCIe counters are shown beside the counted `h2d_gbps`,
never instead of it. Whatever this machine cannot tell (no GPU, no NVML, no
model loaded) is None, never a made-up number. `extra` names the drafter and the
prefetch policy the running (or last) reply resolved to (`{"spec": "draft",
"prefetch": "spmoe"}`), so a live view need not guess what `auto` became.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import psutil
import torch

from engine.device_cache.stats import PhaseCounters
from engine.metrics import LiveGeneration, cache_snapshot
from engine.worker.protocol import Stats

log = logging.getLogger(__name__)

GENERATING_INTERVAL_S = 0.25
IDLE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class GpuSample:
    used_bytes: int
    total_bytes: int
    pcie_rx_gbps: float | None  # host → device, as NVML samples it
    pcie_tx_gbps: float | None


class GpuMonitor:
    """NVML readings for one CUDA device; `open` returns None where NVML is not available."""

    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle

    @classmethod
    def open(cls, device: torch.device) -> GpuMonitor | None:
        if device.type != "cuda":
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = "GPU-" + str(torch.cuda.get_device_properties(index).uuid)
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except pynvml.NVMLError:  # older drivers spell the uuid differently: fall back to the index
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            return cls(pynvml, handle)
        except Exception as err:  # ImportError, NVMLError_LibraryNotFound, …: telemetry goes without
            log.info("NVML is not available (%s): VRAM and PCIe readings are left out.", err)
            return None

    def sample(self) -> GpuSample | None:
        nvml = self._nvml
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except nvml.NVMLError:
            return None
        rx, tx = self._pcie(nvml.NVML_PCIE_UTIL_RX_BYTES), self._pcie(nvml.NVML_PCIE_UTIL_TX_BYTES)
        return GpuSample(int(memory.used), int(memory.total), rx, tx)

    def _pcie(self, counter) -> float | None:
        try:
            return self._nvml.nvmlDeviceGetPcieThroughput(self._handle, counter) * 1e3 / 1e9  # KB/s
        except self._nvml.NVMLError:
            return None


@dataclass
class _Reading:
    at: float
    totals: PhaseCounters
    generated: int


class Telemetry:
    """Builds `Stats` for the model the worker has loaded and the generation it runs.

    `sample()` is called from the telemetry thread and for `GetStats`; rates are over the time
    since the previous sample."""

    def __init__(self):
        self.model = None
        self.live: LiveGeneration | None = None
        self.generating = False
        self._decoding: dict[str, str] = {}  # resolved for the reply, until its decoder is built
        self._gpu: GpuMonitor | None = None
        self._previous: _Reading | None = None
        self._process = psutil.Process(os.getpid())

    def attach(self, model) -> None:
        # The last run's decoder holds its model: forget it, or an unloaded model stays in memory.
        self.model, self.live, self._previous = model, None, None
        self._gpu = GpuMonitor.open(model.device) if model is not None else None

    def begin(self, live: LiveGeneration, spec: str | None = None, prefetch: str | None = None) -> None:
        """A reply starts; `spec` and `prefetch` are the modes resolved for it (the decoder's own
        are reported once it is built)."""
        self.live, self.generating = live, True
        self._decoding = {key: value for key, value in (("spec", spec), ("prefetch", prefetch)) if value}

    def end(self) -> None:
        self.generating = False

    @property
    def interval_s(self) -> float:
        return GENERATING_INTERVAL_S if self.generating else IDLE_INTERVAL_S

    def sample(self, request_id: str = "") -> Stats:
        now = time.perf_counter()
        model, live = self.model, self.live
        totals, phases = self._cache_totals(model)
        reading = _Reading(now, totals, live.generated if live is not None else 0)
        previous, self._previous = self._previous, reading
        interval = _Interval(previous, reading) if previous is not None else None
        run = live.stats(model.cache, now, model.simulated_link) if live is not None and model else None
        gpu = self._gpu.sample() if self._gpu is not None else None
        memory = psutil.virtual_memory()
        cuda = model is not None and model.device.type == "cuda"
        return Stats(
            request_id=request_id,
            time_s=time.monotonic(),
            generating=self.generating,
            simulated_link=model.simulated_link if model is not None else None,
            vram_used_bytes=gpu.used_bytes if gpu else None,
            vram_total_bytes=gpu.total_bytes if gpu else None,
            torch_allocated_bytes=torch.cuda.memory_allocated(model.device) if cuda else None,
            torch_reserved_bytes=torch.cuda.memory_reserved(model.device) if cuda else None,
            host_ram_used_bytes=int(memory.total - memory.available),
            host_ram_total_bytes=int(memory.total),
            process_rss_bytes=int(self._process.memory_info().rss),
            h2d_bytes=totals.bytes_copied,
            h2d_gbps=interval.gbps if interval else None,
            pcie_rx_gbps=gpu.pcie_rx_gbps if gpu else None,
            pcie_tx_gbps=gpu.pcie_tx_gbps if gpu else None,
            hits=totals.hits,
            misses=totals.misses,
            hit_rate=interval.hit_rate if interval else None,
            hit_rate_total=totals.hit_rate,
            hit_rate_by_phase={name: c.hit_rate for name, c in phases.items()},
            generated_tokens=reading.generated,
            tokens_per_s=interval.tokens_per_s if interval and self.generating else None,
            tpot_ms=run.tpot_ms if run else None,
            accept_len=run.accept_len if run else None,
            prefetch_precision=run.prefetch_precision if run else None,
            prefetch_recall=run.prefetch_recall if run else None,
            cutoff_layer=_cutoff_layer(live),
            cache_slots_used=model.cache.used_slots if model is not None else None,
            cache_slots_total=model.cache.n_slots if model is not None else None,
            extra=_decoding(live, self._decoding),
        )

    @staticmethod
    def _cache_totals(model) -> tuple[PhaseCounters, dict[str, PhaseCounters]]:
        if model is None:
            return PhaseCounters(), {}
        with model.cache.lock:  # the engine thread may add a phase while we read
            phases = cache_snapshot(model.cache)
        totals = PhaseCounters()
        for counters in phases.values():
            totals.add(counters)
        return totals, phases


class _Interval:
    """Rates between two readings."""

    def __init__(self, before: _Reading, after: _Reading):
        seconds = max(after.at - before.at, 1e-9)
        hits = after.totals.hits - before.totals.hits
        uses = hits + after.totals.misses - before.totals.misses
        self.gbps = (after.totals.bytes_copied - before.totals.bytes_copied) / seconds / 1e9
        self.hit_rate = hits / uses if uses > 0 else None
        self.tokens_per_s = max(after.generated - before.generated, 0) / seconds


def _decoding(live: LiveGeneration | None, resolved: dict[str, str]) -> dict[str, str]:
    """The drafter (`draft`, `self`, `substitute`, `none`) and the prefetch policy (`spmoe`,
    `next-layer`, `hybrimoe`, `none`) the reply runs with: its decoder's, once built."""
    decoder = live.decoder if live is not None else None
    if decoder is None:
        return dict(resolved) if live is not None else {}
    drafter, prefetch = getattr(decoder, "drafter", None), getattr(decoder, "prefetch", None)
    return {
        "spec": drafter.name if drafter is not None else "none",
        "prefetch": prefetch.policy if prefetch is not None else "none",
    }


def _cutoff_layer(live: LiveGeneration | None) -> int | None:
    decoder = live.decoder if live is not None else None
    prefetch = getattr(decoder, "prefetch", None)
    return prefetch.cutoff_layer if prefetch is not None else None
