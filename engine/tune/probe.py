"""Probe the machine auto-tune plans for: GPU, host→device link, CPU and RAM.

`probe(device)` returns a `Probe` of measured values. On CUDA it reads the GPU's
name, uuid and free memory from torch, the PCIe generation and width from NVML
(None when pynvml or the driver's NVML is missing), and times pinned host→device
copies of expert-sized buffers on a side stream with CUDA events; a least-squares
line through (bytes, time) gives the link's bandwidth (its slope) and per-copy
latency (its intercept). Without a GPU there is no link: the probe reports the
simulated link it is given, or else a measured host memcpy, marks
`simulated_link=True` and says so in `note`; it never invents a PCIe figure.
Everywhere it counts CPU cores and RAM (psutil) and times one SwiGLU expert of a
typical size for one token on the CPU (the cost of hybrid CPU execution).
A probe takes well under 3 s.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import psutil
import torch

from engine.errors import InvalidRequestError
from engine.loader import resolve_device
from engine.tune.types import Probe

log = logging.getLogger(__name__)

# A typical routed expert (Qwen3-30B-A3B: hidden 2048, expert intermediate 768, bf16 ≈ 9.4 MB).
CPU_EXPERT_HIDDEN = 2048
CPU_EXPERT_INTERMEDIATE = 768
CPU_EXPERT_DTYPE = torch.bfloat16
_SIZE_FRACTIONS = (0.25, 0.5, 1.0, 2.0)  # copy sizes, as fractions of one expert
_COPIES_PER_SIZE = 8
_BLOCKS_PER_SIZE = 3


@dataclass(frozen=True)
class LinkFit:
    """time_ms = latency_us / 1e3 + nbytes / (gbps · 1e6): a line through measured copies."""

    gbps: float
    latency_us: float


def probe(
    device: str = "auto",
    sim_link_gbps: float | None = None,
    sim_latency_us: float = 10.0,
    expert_nbytes: int = 8 << 20,
) -> Probe:
    """Measure this machine for copies of `expert_nbytes`; `sim_*` describe the link of a CPU device."""
    target = _resolve_device(device)
    cores, cores_kind = _cpu_cores()
    memory = psutil.virtual_memory()
    cpu_expert_ms = measure_cpu_expert_ms()
    common = dict(
        cpu_cores=cores,
        ram_total_bytes=int(memory.total),
        ram_available_bytes=int(memory.available),
        cpu_expert_ms=cpu_expert_ms,
    )
    cpu_note = f"{cores} {cores_kind} CPU cores, one bf16 expert on the CPU {cpu_expert_ms:.2f} ms/token"
    if target.type == "cuda":
        return _probe_cuda(target, expert_nbytes, common, cpu_note)
    return _probe_cpu(sim_link_gbps, sim_latency_us, expert_nbytes, common, cpu_note)


def _resolve_device(name: str) -> torch.device:
    device = resolve_device(name)  # the loader's rule: auto, cpu, cuda[:N], refused without CUDA
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"Cannot probe a {device.type} device; use auto, cpu, cuda or cuda:N.")
    return device


def _probe_cuda(device: torch.device, expert_nbytes: int, common: dict, cpu_note: str) -> Probe:
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(index)
    uuid = str(props.uuid)
    uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    free, total = torch.cuda.mem_get_info(device)
    pcie = _nvml_pcie(uuid)
    fit = fit_link(_cuda_copy_samples(device, expert_nbytes))
    pcie_note = (
        f"PCIe gen {pcie[1]}/{pcie[0]} x{pcie[3]}/{pcie[2]} (current/max)"
        if pcie[0] is not None
        else "PCIe link unknown (no NVML)"
    )
    note = (
        f"{props.name}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free; {pcie_note}; pinned copies "
        f"{fit.gbps:.1f} GB/s + {fit.latency_us:.1f} µs each; {cpu_note}"
    )
    return Probe(
        device_kind="cuda",
        gpu_name=props.name,
        gpu_uuid=uuid,
        vram_total_bytes=int(total),
        vram_free_bytes=int(free),
        pcie_gen_max=pcie[0],
        pcie_gen_current=pcie[1],
        pcie_width_max=pcie[2],
        pcie_width_current=pcie[3],
        h2d_gbps=fit.gbps,
        h2d_latency_us=fit.latency_us,
        simulated_link=False,
        note=note,
        **common,
    )


def _probe_cpu(
    sim_link_gbps: float | None, sim_latency_us: float, expert_nbytes: int, common: dict, cpu_note: str
) -> Probe:
    if sim_link_gbps is not None:
        if not sim_link_gbps > 0:
            raise InvalidRequestError(f"The simulated link needs a bandwidth > 0 GB/s, got {sim_link_gbps}.")
        gbps, latency_us = float(sim_link_gbps), float(sim_latency_us)
        link_note = f"a simulated link of {gbps:g} GB/s and {latency_us:g} µs per copy"
    else:
        fit = fit_link(_memcpy_samples(expert_nbytes))
        gbps, latency_us = fit.gbps, fit.latency_us
        link_note = (
            f"no GPU link exists, so the link figures are a host memcpy of expert-sized buffers "
            f"({gbps:.1f} GB/s + {latency_us:.1f} µs), not a PCIe measurement"
        )
    return Probe(
        device_kind="cpu",
        gpu_name=None,
        gpu_uuid=None,
        vram_total_bytes=None,
        vram_free_bytes=None,
        pcie_gen_max=None,
        pcie_gen_current=None,
        pcie_width_max=None,
        pcie_width_current=None,
        h2d_gbps=gbps,
        h2d_latency_us=latency_us,
        simulated_link=True,
        note=f"No GPU: probed the CPU and {link_note}; {cpu_note}",
        **common,
    )


def _cpu_cores() -> tuple[int, str]:
    physical = psutil.cpu_count(logical=False)
    if physical:
        return physical, "physical"
    return psutil.cpu_count(logical=True) or 1, "logical"


def _nvml_pcie(uuid: str) -> tuple[int | None, int | None, int | None, int | None]:
    """(max generation, current generation, max width, current width); all None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None, None, None, None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        log.info("NVML is unavailable (%s): PCIe link fields left empty", err)
        return None, None, None, None
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        return (
            pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle),
            pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle),
            pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle),
            pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle),
        )
    except pynvml.NVMLError as err:
        log.info("NVML cannot read the PCIe link of %s (%s)", uuid, err)
        return None, None, None, None
    finally:
        pynvml.nvmlShutdown()


def _copy_sizes(expert_nbytes: int) -> list[int]:
    return [max(int(expert_nbytes * f), 4096) for f in _SIZE_FRACTIONS]


def _cuda_copy_samples(device: torch.device, expert_nbytes: int) -> list[tuple[int, float]]:
    """(bytes, ms per copy) of pinned host→device copies on a side stream, timed with CUDA events."""
    sizes = _copy_sizes(expert_nbytes)
    src = torch.empty(max(sizes), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    samples = []
    with torch.cuda.stream(stream):
        for size in sizes:
            dst[:size].copy_(src[:size], non_blocking=True)  # warm-up
            blocks = []
            for _ in range(_BLOCKS_PER_SIZE):  # the fastest block: other work only ever slows copies
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                for _ in range(_COPIES_PER_SIZE):
                    dst[:size].copy_(src[:size], non_blocking=True)
                end.record(stream)
                end.synchronize()
                blocks.append(start.elapsed_time(end) / _COPIES_PER_SIZE)
            samples.append((size, min(blocks)))
    return samples


def _memcpy_samples(expert_nbytes: int) -> list[tuple[int, float]]:
    """(bytes, ms per copy) of host memcpys: all a machine without a GPU has in place of a link."""
    sizes = _copy_sizes(expert_nbytes)
    src = torch.ones(max(sizes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    samples = []
    for size in sizes:
        ms = _median_ms(lambda n=size: dst[:n].copy_(src[:n]), repeats=_COPIES_PER_SIZE)
        samples.append((size, ms))
    return samples


def fit_link(samples: Sequence[tuple[int, float]]) -> LinkFit:
    """Least-squares line `ms = a + b · bytes` through (bytes, ms) samples: bandwidth 1/b, latency a.

    The latency cannot be negative: where the free line's intercept is (timing noise on a fast
    link), the line is fitted through the origin instead, so its slope is not steepened to reach
    a negative intercept (which read a fast link as a slow one)."""
    if len(samples) < 2 or len({n for n, _ in samples}) < 2:
        raise ValueError("fitting a link needs samples of at least two copy sizes")
    xs = [float(n) for n, _ in samples]
    ys = [ms for _, ms in samples]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True))
    slope /= sum((x - mean_x) ** 2 for x in xs)
    intercept = mean_y - slope * mean_x
    if intercept < 0:
        slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
        intercept = 0.0
    if slope <= 0:  # copies too fast to resolve: use the largest copy's own rate
        n, ms = max(samples)
        return LinkFit(gbps=n / max(ms, 1e-6) / 1e6, latency_us=0.0)
    return LinkFit(gbps=1.0 / slope / 1e6, latency_us=intercept * 1e3)


def measure_cpu_expert_ms(
    hidden: int = CPU_EXPERT_HIDDEN, intermediate: int = CPU_EXPERT_INTERMEDIATE, repeats: int = 5
) -> float:
    """Median CPU time of one SwiGLU expert (`down(silu(gate x) · up x)`) for one token."""
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(2 * intermediate, hidden, generator=gen).to(CPU_EXPERT_DTYPE)  # [2I, H]
    down = torch.randn(hidden, intermediate, generator=gen).to(CPU_EXPERT_DTYPE)  # [H, I]
    x = torch.randn(1, hidden, generator=gen).to(CPU_EXPERT_DTYPE)  # [1, H]

    def expert() -> torch.Tensor:
        gate, up = (x @ gate_up.T).chunk(2, dim=-1)  # [1, I] each
        return (torch.nn.functional.silu(gate) * up) @ down.T  # [1, H]

    with torch.inference_mode():
        return _median_ms(expert, repeats)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
