"""The simulated host→device link, alone and under a tiny offloaded model.

The link must copy exactly, take at least latency + bytes / bandwidth per copy, serialise its
copies as one PCIe link does, and hand a failed copy's error to the waiter. Under a model, every
miss copies one packed expert (the byte counters are exact), and decode time grows with the
bytes copied as the link's bandwidth says.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.device_cache.transfer import LinkMeter, SimulatedLink, make_transfer
from engine.generation import GenerationConfig, generate_text
from engine.loader import load_model
from engine.sampling import SamplingConfig
from engine.tiny.models import make_tiny_model

MB = 10**6


@pytest.fixture
def open_links():
    """Links made through this fixture are closed after the test, even when it fails."""
    links: list[SimulatedLink] = []

    def make(gbps: float | None = None, latency_us: float = 0.0) -> SimulatedLink:
        links.append(SimulatedLink(gbps, latency_us))
        return links[-1]

    yield make
    for link in links:
        link.close()


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def timed_copies(link: SimulatedLink, count: int, nbytes: int) -> tuple[list[float], list[torch.Tensor]]:
    """Issue `count` copies back to back; seconds from the first issue until each one landed."""
    sources = [random_bytes(nbytes, seed) for seed in range(count)]
    targets = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]
    started = time.perf_counter()
    handles = [link.copy(dst, src) for dst, src in zip(targets, sources, strict=True)]
    landed = []
    for handle in handles:
        handle.wait()
        landed.append(time.perf_counter() - started)
    for dst, src in zip(targets, sources, strict=True):
        assert torch.equal(dst, src)
    return landed, targets


# -- the link alone -----------------------------------------------------------------------------


@pytest.mark.parametrize("gbps", [None, 1.0])
def test_copies_are_exact(open_links, gbps) -> None:
    link = open_links(gbps)
    for nbytes in (1, 63, 4096, 3 * MB + 7):
        src = random_bytes(nbytes, seed=nbytes)
        dst = torch.zeros_like(src)
        handle = link.copy(dst, src)
        handle.wait()
        assert handle.done()
        assert torch.equal(dst, src)
    floats = torch.randn(33, 17)
    dst = torch.empty_like(floats)
    link.copy(dst, floats).wait()
    assert torch.equal(dst, floats)


def test_a_copy_takes_latency_plus_bytes_over_bandwidth(open_links) -> None:
    gbps, latency_us, nbytes = 0.05, 5000.0, 1 * MB  # 5 ms + 20 ms
    expected = latency_us / 1e6 + nbytes / (gbps * 1e9)
    link = open_links(gbps, latency_us)
    src, dst = random_bytes(nbytes), torch.zeros(nbytes, dtype=torch.uint8)

    started = time.perf_counter()
    handle = link.copy(dst, src)
    assert not handle.done()  # 25 ms to go
    handle.wait()
    elapsed = time.perf_counter() - started

    assert handle.done() and torch.equal(dst, src)
    assert elapsed >= expected
    assert elapsed < expected + 0.25  # generous: only catches a link far slower than it says


def test_copies_are_serialised_on_the_link(open_links) -> None:
    gbps, nbytes = 0.05, 1 * MB  # 20 ms per copy
    one = nbytes / (gbps * 1e9)
    link = open_links(gbps)

    landed, _ = timed_copies(link, 2, nbytes)
    assert landed[0] >= one
    assert landed[1] >= 2 * one  # the second waits for the first: one link, not two
    assert landed[1] < 2 * one + 0.25

    # An idle link owes nothing: a copy issued after a pause takes one copy's time, not more.
    time.sleep(3 * one)
    landed, _ = timed_copies(link, 1, nbytes)
    assert one <= landed[0] < one + 0.25


def test_a_failed_copy_raises_from_wait_and_the_link_goes_on(open_links) -> None:
    link = open_links(1.0)
    handle = link.copy(torch.zeros(10, dtype=torch.uint8), random_bytes(20))  # sizes disagree
    with pytest.raises(RuntimeError):
        handle.wait()
    assert handle.done()
    with pytest.raises(RuntimeError):  # every waiter sees it, not only the first
        handle.wait()

    src, dst = random_bytes(100), torch.zeros(100, dtype=torch.uint8)
    link.copy(dst, src).wait()
    assert torch.equal(dst, src)


def test_close_stops_the_link_thread() -> None:
    link = SimulatedLink(gbps=None)
    link.copy(torch.zeros(4, dtype=torch.uint8), random_bytes(4)).wait()
    link.close()
    assert not link._thread.is_alive()


def test_make_transfer_on_the_cpu_is_a_simulated_link() -> None:
    link = make_transfer(torch.device("cpu"), 2.5, 7.0)
    try:
        assert isinstance(link, SimulatedLink) and link.simulated
        assert link.gbps == 2.5 and link.latency_s == pytest.approx(7e-6)
    finally:
        link.close()
    unlimited = make_transfer(torch.device("cpu"), None, 7.0)
    try:
        assert unlimited.gbps is None and unlimited.latency_s == 0.0  # no link, no latency
    finally:
        unlimited.close()


# -- under a tiny offloaded model ---------------------------------------------------------------

# Wide experts (1.5 MiB each in fp32) so the link, not compute, dominates a decode step.
WIDE_EXPERTS = {"moe_intermediate_size": 2048}
PROMPT = list(range(40, 56))
GREEDY = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(greedy=True), ignore_eos=True)
LATENCY_US = 10.0


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("wide-qwen3"), "qwen3_moe", seed=0, **WIDE_EXPERTS)


def run_greedy(folder, gbps: float | None, policy: str = "lru"):
    """A fresh model (cold cache) generating GREEDY from PROMPT: (finished, expert bytes, cache totals)."""
    config = OffloadConfig(
        device="cpu",
        expert_budget=ExpertBudget(experts=4),
        policy=policy,
        sim_link_gbps=gbps,
        sim_latency_us=LATENCY_US,
    )
    model = load_model(folder, config)
    try:
        finished = generate_text(model, PROMPT, GREEDY)
        return finished, model.store.layout.nbytes, model.cache.stats.total()
    finally:
        model.close()


@pytest.mark.parametrize("policy", ["lru", "lfu", "mrs"])
def test_bytes_copied_are_exactly_one_expert_per_miss(wide_model_dir, policy) -> None:
    finished, nbytes, cache_total = run_greedy(wide_model_dir, None, policy)
    stats = finished.stats

    assert stats.simulated_link
    assert len(finished.token_ids) == GREEDY.max_new_tokens
    assert stats.h2d_bytes == stats.misses * nbytes
    assert stats.prefill.h2d_bytes == stats.prefill.misses * nbytes
    assert stats.decode.h2d_bytes == stats.decode.misses * nbytes
    assert stats.misses == stats.prefill.misses + stats.decode.misses
    assert stats.prefill.misses >= 4  # a cold cache
    assert stats.decode.misses > GREEDY.max_new_tokens  # 4 slots for 2 layers × top-2: it evicts
    # 2 MoE layers × top-2 experts: one use of each chosen expert per layer and decode step.
    assert stats.decode.hits + stats.decode.misses == 2 * 2 * (GREEDY.max_new_tokens - 1)
    assert cache_total.copies == stats.misses  # no prefetch: every copy is a miss


def test_decode_time_grows_with_bytes_as_the_bandwidth_says(wide_model_dir) -> None:
    slow_gbps, fast_gbps = 0.05, 0.1
    # Interleaved repeats; the fastest of each is the least disturbed by other load on the machine.
    runs = {gbps: [] for gbps in (slow_gbps, fast_gbps)}
    for _ in range(2):
        for gbps in runs:
            runs[gbps].append(run_greedy(wide_model_dir, gbps)[0])
    reference = runs[slow_gbps][0]
    decode_bytes, misses = reference.stats.decode.h2d_bytes, reference.stats.decode.misses

    for gbps, finished_runs in runs.items():
        for finished in finished_runs:
            # The same tokens route the same way through the same deterministic cache: the same copies.
            assert finished.token_ids == reference.token_ids
            assert finished.stats.decode.misses == misses
            assert finished.stats.decode.h2d_bytes == decode_bytes
            # Every decode copy is waited for within the decode phase, and copies never overlap on
            # the link: decode takes at least the link's time for its bytes.
            link_s = decode_bytes / (gbps * 1e9) + misses * LATENCY_US / 1e6
            assert finished.stats.decode_ms / 1e3 >= link_s

    expected_s = decode_bytes * (1 / (slow_gbps * 1e9) - 1 / (fast_gbps * 1e9))
    assert expected_s >= 0.3, "too few bytes for a robust timing comparison"
    slow_ms, fast_ms = (min(f.stats.decode_ms for f in runs[gbps]) for gbps in (slow_gbps, fast_gbps))
    measured_s = (slow_ms - fast_ms) / 1e3
    assert measured_s == pytest.approx(expected_s, rel=0.25)


def test_a_meter_sums_the_links_copy_time_and_computes_waits() -> None:
    """Two 10 MB copies at 0.1 GB/s (100 ms each, modelled): compute waits for the first and works
    through the second, so about half the copying was hidden."""
    link = SimulatedLink(gbps=0.1, latency_us=0.0)
    link.meter = meter = LinkMeter()
    try:
        src, dst = torch.ones(10_000_000, dtype=torch.uint8), torch.empty(10_000_000, dtype=torch.uint8)
        link.copy(dst, src).wait()
        second = link.copy(dst, src)
        time.sleep(0.3)  # compute meanwhile
        second.wait()
        copy_s, wait_s = meter.settle()
        assert copy_s == pytest.approx(0.2, rel=1e-6)  # the modelled times, not the memcpy's
        assert 0.05 < wait_s < copy_s
        assert 0.25 < meter.hidden < 0.75
    finally:
        link.close()
    assert LinkMeter().hidden is None  # no copies: nothing to hide
