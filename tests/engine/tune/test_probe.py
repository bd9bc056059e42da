"""The machine probe: honest CPU/simulated figures without a GPU, measured ones with."""

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.tune.probe import fit_link, measure_cpu_expert_ms, probe

PCIE_FIELDS = ("pcie_gen_max", "pcie_gen_current", "pcie_width_max", "pcie_width_current")


def test_cpu_probe_reports_no_gpu_and_no_pcie():
    result = probe("cpu")
    assert result.device_kind == "cpu"
    assert result.gpu_name is None and result.gpu_uuid is None
    assert result.vram_total_bytes is None and result.vram_free_bytes is None
    assert all(getattr(result, name) is None for name in PCIE_FIELDS)
    assert result.simulated_link  # no link exists: whatever is reported is not a PCIe measurement
    assert result.h2d_gbps > 0 and result.h2d_latency_us >= 0
    assert "No GPU" in result.note and "not a PCIe measurement" in result.note
    assert result.cpu_cores >= 1
    assert 0 < result.ram_available_bytes <= result.ram_total_bytes
    assert result.cpu_expert_ms is not None and result.cpu_expert_ms > 0


def test_cpu_probe_reports_the_simulated_link_it_is_given():
    result = probe("cpu", sim_link_gbps=16.0, sim_latency_us=25.0)
    assert result.simulated_link
    assert result.h2d_gbps == 16.0
    assert result.h2d_latency_us == 25.0
    assert "simulated link of 16 GB/s" in result.note
    assert all(getattr(result, name) is None for name in PCIE_FIELDS)


def test_fit_link_recovers_bandwidth_and_latency_of_a_line():
    gbps, latency_us = 12.5, 8.0
    samples = [(n, latency_us / 1e3 + n / (gbps * 1e6)) for n in (1 << 20, 2 << 20, 4 << 20, 8 << 20)]
    fit = fit_link(samples)
    assert fit.gbps == pytest.approx(gbps, rel=1e-9)
    assert fit.latency_us == pytest.approx(latency_us, rel=1e-6)


def test_fit_link_is_least_squares_through_noisy_samples():
    # By hand: mean (2.5e5, 0.035), Sxy = 4.8e3, Sxx = 5e10, slope 9.6e-8 ms/byte, intercept
    # 0.035 - 0.024 = 0.011 ms.
    samples = [(1e5, 0.02), (2e5, 0.032), (3e5, 0.038), (4e5, 0.05)]
    fit = fit_link(samples)
    assert fit.gbps == pytest.approx(10.0 * 100 / 96, rel=1e-9)  # slope 9.6e-8 ms/byte
    assert fit.latency_us == pytest.approx(11.0, rel=1e-9)


def test_fit_link_clamps_a_negative_intercept_and_needs_two_sizes():
    # the free line (slope 1.1e-7 ms/byte, 9.1 GB/s) crosses zero below 0: the line through the
    # origin instead, slope (1e6·0.09 + 2e6·0.2) / (1e12 + 4e12) = 9.8e-8 ms/byte
    fit = fit_link([(1e6, 0.09), (2e6, 0.2)])
    assert fit.latency_us == 0.0 and fit.gbps == pytest.approx(1 / 9.8e-8 / 1e6, rel=1e-9)
    with pytest.raises(ValueError):
        fit_link([(1e6, 0.1), (1e6, 0.2)])


def test_cpu_expert_time_grows_with_the_expert():
    # the best of three medians: on a loaded 2-core machine a thread pool's wake-up can stall a
    # whole median of the tiny expert (seen: 16 ms, the large one's time)
    small = min(measure_cpu_expert_ms(hidden=256, intermediate=64, repeats=5) for _ in range(3))
    large = measure_cpu_expert_ms(hidden=4096, intermediate=1536, repeats=3)
    assert 0 < small < large


def test_bad_devices_and_links_are_refused():
    with pytest.raises(InvalidRequestError):
        probe("tpu")
    with pytest.raises(InvalidRequestError):
        probe("cpu", sim_link_gbps=0.0)
    if not torch.cuda.is_available():
        with pytest.raises(InvalidRequestError, match="no CUDA GPU"):
            probe("cuda")


@pytest.mark.gpu
def test_cuda_probe_measures_the_gpu_and_its_link():
    result = probe("cuda")
    assert result.device_kind == "cuda"
    assert result.gpu_name and result.gpu_uuid.startswith("GPU-")
    assert 0 < result.vram_free_bytes <= result.vram_total_bytes
    assert not result.simulated_link
    assert 0.5 < result.h2d_gbps < 1000
    assert result.h2d_latency_us >= 0
    if result.pcie_gen_max is not None:  # NVML present
        assert 1 <= result.pcie_gen_current <= result.pcie_gen_max
        assert 1 <= result.pcie_width_current <= result.pcie_width_max
