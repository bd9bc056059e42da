"""The CUDA path: pinned host store, the copy stream and its events, end-to-end equivalence, OOM.

Every test needs a CUDA device (conftest skips them without one). Ordering between the copy
stream and the compute stream is checked by stalling one stream with `torch.cuda._sleep`, long
enough (~0.5 s) that an ordering bug would let the other side overtake it.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import AutoModelForCausalLM

from engine.config import ExpertBudget, OffloadConfig
from engine.device_cache.eviction import LRUPolicy
from engine.device_cache.expert_cache import ExpertCache
from engine.device_cache.transfer import CudaTransfer, LinkMeter, make_transfer
from engine.errors import DeviceOutOfMemoryError
from engine.formats.layout import ExpertLayout
from engine.generation import GenerationConfig, generate_text
from engine.loader import load_model
from engine.moe.batched_experts import groupable
from engine.sampling import SamplingConfig
from engine.store.host_store import ExpertStore
from engine.tiny.gguf_writer import gguf_config, write_tiny_gguf
from engine.tiny.models import build_tiny_model, save_tiny_model
from tests.engine.exactness import assert_matches_reference

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 1_000_000_000  # GPU clock cycles: about 0.5 s at 2 GHz
MATRIX = 1024  # a [MATRIX, MATRIX] fp32 matrix is 4 MiB
PROMPT = [3, 17, 42, 99, 7, 250, 11, 64]


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def transfer(cuda) -> CudaTransfer:
    return CudaTransfer(cuda)


def pinned_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a CPU tensor, flat, in pinned memory."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).pin_memory()


def random_matrix(seed: int) -> torch.Tensor:
    return torch.randn(MATRIX, MATRIX, generator=torch.Generator().manual_seed(seed))


def as_matrix(slot_bytes: torch.Tensor) -> torch.Tensor:
    return slot_bytes.view(torch.float32).view(MATRIX, MATRIX)


def matrix_store() -> ExpertStore:
    """Two experts of one layer, each a single [MATRIX, MATRIX] fp32 field, pinned."""
    layout = ExpertLayout.from_shapes({"w": (MATRIX, MATRIX)}, torch.float32)
    packed = torch.stack([pinned_bytes(random_matrix(seed)) for seed in (10, 11)]).pin_memory()
    assert packed.shape == (2, layout.nbytes)
    return ExpertStore(layout, {0: packed}, num_experts=2)


# -- the copy stream -----------------------------------------------------------------------------


def test_copies_land_exactly(cuda, transfer) -> None:
    generator = torch.Generator().manual_seed(0)
    for nbytes in (1, 4096, 3 * 2**20 + 5):
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).pin_memory()
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=cuda)
        handle = transfer.copy(dst, src)
        handle.wait()
        torch.cuda.synchronize()
        assert handle.done()
        assert torch.equal(dst.cpu(), src)


def test_copies_run_on_their_own_stream_beside_compute(cuda, transfer) -> None:
    compute = torch.cuda.current_stream(cuda)
    assert transfer.stream != compute
    src = pinned_bytes(random_matrix(1))
    dst = torch.zeros_like(src, device=cuda)
    torch.cuda.synchronize()

    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy for ~0.5 s
    handle = transfer.copy(dst, src)
    handle.event.synchronize()  # the host waits for the copy alone
    assert handle.done()
    assert not compute.query(), "the copy waited for compute: it is not on a stream of its own"
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)


def test_synchronize_blocks_the_host_until_the_copy_lands_without_spinning(cuda, transfer) -> None:
    src = pinned_bytes(random_matrix(2))
    dst = torch.zeros_like(src, device=cuda)
    torch.cuda.synchronize()
    with torch.cuda.stream(transfer.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy stream is busy for ~0.5 s: the copy lands after it
    handle = transfer.copy(dst, src)
    assert not handle.done()
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    handle.synchronize()
    cpu_s, wall_s = time.process_time() - cpu_before, time.perf_counter() - wall_before
    assert handle.done() and torch.equal(dst.cpu(), src)
    assert wall_s > 0.1 and cpu_s < 0.5 * wall_s, f"the host spun: {cpu_s:.2f} s CPU in {wall_s:.2f} s"


def test_wait_makes_compute_read_the_slot_only_after_the_copy(cuda, transfer) -> None:
    src = pinned_bytes(random_matrix(2))
    slot = torch.zeros_like(src, device=cuda)
    torch.cuda.synchronize()
    stall = torch.cuda.Stream(device=cuda)  # holds the copy back for ~0.5 s
    with torch.cuda.stream(stall):
        torch.cuda._sleep(SLEEP_CYCLES)
        copy_may_start = torch.cuda.Event()
        copy_may_start.record(stall)

    handle = transfer.copy(slot, src, after=copy_may_start)
    assert not handle.done()
    handle.wait()  # the compute stream waits; the host does not
    seen = slot.clone()  # runs on the compute stream, after the copy
    torch.cuda.synchronize()
    assert handle.done()
    assert torch.equal(seen.cpu(), src)


def test_copy_after_a_release_marker_does_not_overwrite_a_slot_in_use(cuda, transfer) -> None:
    old, new = random_matrix(3), random_matrix(4)
    slot = torch.empty(MATRIX * MATRIX * 4, dtype=torch.uint8, device=cuda)
    weights = as_matrix(slot)

    def reset_slot() -> None:
        weights.copy_(old.to(cuda))
        torch.cuda.synchronize()

    reset_slot()
    expected = weights @ weights  # [MATRIX, MATRIX] on the old contents
    new_bytes = pinned_bytes(new)

    # Compute reads the slot late (behind a stall), then releases it; the overwrite waits for that.
    torch.cuda._sleep(SLEEP_CYCLES)
    result = weights @ weights
    marker = transfer.release_marker()
    handle = transfer.copy(slot, new_bytes, after=marker)
    assert not handle.done(), "the overwrite did not wait for compute"
    torch.cuda.synchronize()
    assert handle.done()
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(weights.cpu(), new)

    # Control: without `after`, the same overwrite lands during the stall and compute reads the
    # new contents, so the check above can tell the two orders apart.
    reset_slot()
    torch.cuda._sleep(SLEEP_CYCLES)
    raced = weights @ weights
    transfer.copy(slot, new_bytes)
    torch.cuda.synchronize()
    assert not torch.allclose(raced, expected, rtol=1e-3, atol=1e-2)


def test_cache_reuses_a_slot_only_after_compute_released_it(cuda, transfer) -> None:
    store = matrix_store()
    assert store.pinned
    cache = ExpertCache(store, 1, cuda, transfer, LRUPolicy())
    first = cache.acquire((0, 0))
    w = cache.wait(first)["w"]
    expected = store.views(0, 0)["w"].to(cuda) @ store.views(0, 0)["w"].to(cuda)
    torch.cuda.synchronize()

    torch.cuda._sleep(SLEEP_CYCLES)
    result = w @ w  # still queued behind the stall when the slot is handed to another expert
    cache.release(first)
    second = cache.acquire((0, 1))
    assert second is first  # one slot: evicted and reloaded while compute still reads it
    assert not second.copy.done()
    cache.wait(second)
    torch.cuda.synchronize()

    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(cache.pool[second.index].cpu(), store.buffer(0, 1))
    cache.release(second)


def test_a_meter_times_cuda_copies_and_the_compute_streams_waits(cuda) -> None:
    transfer = CudaTransfer(cuda)
    transfer.meter = meter = LinkMeter()
    src = pinned_bytes(random_matrix(3))
    dst = torch.empty_like(src, device=cuda)
    transfer.copy(dst, src).wait()  # the compute stream waits for the whole copy
    torch.cuda.synchronize()
    copy_s, wait_s = meter.settle()
    assert 0 < copy_s < 1 and 0 <= wait_s < 1
    assert 0.0 <= meter.hidden <= 1.0


def test_make_transfer_on_cuda_ignores_the_simulated_link(cuda) -> None:
    transfer = make_transfer(cuda, 1.0, 10.0)
    assert isinstance(transfer, CudaTransfer)
    assert not transfer.simulated


def test_absurd_cache_is_a_device_out_of_memory_error(cuda, transfer) -> None:
    store = matrix_store()  # 4 MiB experts
    free, _ = torch.cuda.mem_get_info(cuda)
    n_slots = 4 * free // store.layout.nbytes
    with pytest.raises(DeviceOutOfMemoryError, match="expert cache"):
        ExpertCache(store, n_slots, cuda, transfer, LRUPolicy())
    torch.cuda.empty_cache()


# -- a tiny model end to end ---------------------------------------------------------------------

GREEDY_32 = GenerationConfig(max_new_tokens=32, sampling=SamplingConfig(greedy=True), ignore_eos=True)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_offloaded_model_on_cuda_matches_transformers(tmp_path, cuda, model_type) -> None:
    folder = save_tiny_model(build_tiny_model(model_type, seed=1), tmp_path / model_type)
    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    reference = reference.to(cuda).eval()
    # A quarter of the 2 MoE layers × 8 experts.
    config = OffloadConfig(device="cuda", dtype="float32", expert_budget=ExpertBudget(experts=4))
    model = load_model(folder, config)
    try:
        assert model.store.pinned
        assert model.cache.pool.device.type == "cuda" and model.cache.n_slots == 4
        assert not model.simulated_link and not model.info().simulated_link
        assert isinstance(model.transfer, CudaTransfer)

        ids = torch.randint(0, reference.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            expected = reference(ids[None].to(cuda)).logits[0]
        logits = model.forward(ids, model.new_kv_cache(), logits_to_keep=0)
        assert logits.device.type == "cuda"
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        assert model.cache.stats.total().misses > 4, "the cache must actually evict"

        with torch.no_grad():
            expected_ids = reference.generate(
                ids[None].to(cuda), max_new_tokens=32, do_sample=False, min_new_tokens=32, eos_token_id=None
            )[0, len(ids) :]
        finished = generate_text(model, ids.tolist(), GREEDY_32)
        assert list(finished.token_ids) == expected_ids.tolist()
        assert not finished.stats.simulated_link
        stats = finished.stats
        assert stats.h2d_bytes == stats.misses * model.store.layout.nbytes
    finally:
        model.close()


def test_a_store_too_big_to_pin_whole_is_pinned_in_place_or_staged_and_outputs_do_not_change(
    tmp_path, cuda, monkeypatch
) -> None:
    """Past PIN_WHOLE_LIMIT the store is pinned where it lies (cudaHostRegister: the same buffers,
    no staging); past REGISTER_RAM_SHARE too it stays pageable and copies pass through the pinned
    staging ring (a few experts wide). The logits are the pinned-whole path's, bit for bit."""
    import engine.store.staging as staging

    folder = save_tiny_model(build_tiny_model("qwen3_moe", seed=1), tmp_path / "qwen3_moe")
    config = OffloadConfig(device="cuda", dtype="float32", expert_budget=ExpertBudget(experts=4))
    ids = torch.randint(0, 100, (24,), generator=torch.Generator().manual_seed(0))
    pinned = load_model(folder, config)
    try:
        assert pinned.store.pinned and pinned.transfer.staging is None
        expected = pinned.forward(ids, pinned.new_kv_cache(), logits_to_keep=0)
    finally:
        pinned.close()
    monkeypatch.setattr(staging, "PIN_WHOLE_LIMIT", 0)
    in_place = load_model(folder, config)
    try:
        assert in_place.store.pinned, "registered memory reads as pinned"
        assert in_place.transfer.staging is None
        logits = in_place.forward(ids, in_place.new_kv_cache(), logits_to_keep=0)
        torch.testing.assert_close(logits, expected, atol=0, rtol=0)
    finally:
        in_place.close()
    monkeypatch.setattr(staging, "REGISTER_RAM_SHARE", 0.0)
    staged = load_model(folder, config)
    try:
        assert not staged.store.pinned
        assert staged.transfer.staging_nbytes == staging.STAGING_SLOTS * staged.store.expert_nbytes
        logits = staged.forward(ids, staged.new_kv_cache(), logits_to_keep=0)
        torch.testing.assert_close(logits, expected, atol=0, rtol=0)
        assert staged.cache.stats.total().misses > 4, "the cache must actually evict (and stage)"
    finally:
        staged.close()


def test_registered_buffers_are_unpinned_when_freed(cuda) -> None:
    from engine.store.staging import register_in_place

    buffers = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(3)]
    assert register_in_place(buffers)
    assert all(buf.is_pinned() for buf in buffers)
    target = torch.empty(1 << 20, dtype=torch.uint8, device=cuda)
    target.copy_(buffers[1], non_blocking=True)
    torch.cuda.synchronize()
    assert int(target.sum()) == 1 << 20
    survivor = buffers[0]
    del buffers
    import gc

    gc.collect()
    assert survivor.is_pinned()  # its own registration stays while it lives


# -- experts computed in groups (CUDA's default for few-token steps) -----------------------------


def _counting_groups(monkeypatch) -> list[int]:
    import engine.moe.batched_experts as grouped

    groups: list[int] = []
    real = grouped.accumulate_together
    monkeypatch.setattr(grouped, "accumulate_together", lambda *a: groups.append(len(a[2])) or real(*a))
    return groups


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_experts_in_groups_on_cuda_match_transformers(tmp_path, cuda, model_type, monkeypatch) -> None:
    """12 of the 16 experts cached: decode steps do not stream, so they compute in groups."""
    groups = _counting_groups(monkeypatch)
    folder = save_tiny_model(build_tiny_model(model_type, seed=1), tmp_path / model_type)
    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    config = OffloadConfig(device="cuda", dtype="float32", expert_budget=ExpertBudget(experts=12))
    model = load_model(folder, config)
    try:
        assert_matches_reference(model, reference.to(cuda).eval(), PROMPT)
        assert groups and model.cache.stats.total().misses > 0
    finally:
        model.close()


def test_a_q4_k_m_gguf_on_cuda_computes_in_groups_exactly(tmp_path, cuda, monkeypatch) -> None:
    """Q4_K gate/up and Q6_K down (llama.cpp's Q4_K_M) stay in their blocks on the device; a group's
    blocks are dequantized together: transformers' own GGUF loading's logits and greedy tokens."""
    groups = _counting_groups(monkeypatch)
    path = write_tiny_gguf(tmp_path, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q8_0)
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=gguf_config(path), dtype=torch.float32
    )
    config = OffloadConfig(device="cuda", dtype="float32", expert_budget=ExpertBudget(experts=12))
    model = load_model(path, config)
    try:
        assert groupable(model.store.layout_of(0))  # no CPU repacking on CUDA
        assert_matches_reference(model, reference.to(cuda).eval(), PROMPT)
        assert groups
    finally:
        model.close()


def _a_whole_q4_k_m_model(tmp_path, cuda):
    """A tiny Q4_K_M GGUF loaded with every expert on the GPU, and transformers' own loading of it."""
    path = write_tiny_gguf(tmp_path, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q8_0)
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=gguf_config(path), dtype=torch.float32
    )
    config = OffloadConfig(device="cuda", dtype="float32", expert_budget=ExpertBudget.parse("all"))
    return load_model(path, config), reference.to(cuda).eval()


def test_a_q4_k_m_gguf_the_gpu_holds_whole_is_filled_at_load_and_decodes_without_host_syncs(
    tmp_path, cuda, monkeypatch
) -> None:
    """Every expert fits: the cache is filled while the model loads, and a decode step reads its
    experts through the slot tables (`grouped.forward_resident`) with no host synchronisation and
    no CUDA synchronize, its norms fused (`model.fused_norms`) — transformers' own GGUF loading's
    logits and greedy tokens."""
    import engine.moe.layer as moe_layer
    from engine.bench.op_counts import HOST_READS, _value_reads

    resident: list[int] = []
    real = moe_layer.forward_resident
    monkeypatch.setattr(moe_layer, "forward_resident", lambda *a: resident.append(a[0].layer) or real(*a))
    model, reference = _a_whole_q4_k_m_model(tmp_path, cuda)
    try:
        cache = model.cache
        assert cache.holds_all and cache.stats.phases["load"].misses == model.store.total_experts
        norms = [m for m in model.hf_model.modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all(isinstance(m.forward, functools.partial) for m in norms)  # fused on CUDA
        assert_matches_reference(model, reference, PROMPT)
        assert resident, "decode steps must read their experts through the slot tables"
        kv = model.new_kv_cache()
        model.forward(torch.tensor(PROMPT), kv, logits_to_keep=1)
        with torch.profiler.profile() as prof, _value_reads() as reads:
            model.forward(torch.tensor(PROMPT[:1], device=cuda), kv)  # no copy from the host
        events = prof.events()
        assert not sum(reads.values()) and not [e.name for e in events if e.name in HOST_READS]
        assert not [e.name for e in events if e.name.endswith("Synchronize")]
        assert cache.stats.total().misses == model.store.total_experts  # the fill's alone
    finally:
        model.close()


def test_expert_cuda_graphs_replay_what_the_eager_steps_compute(tmp_path, cuda) -> None:
    """`ExpertGraphs` on a GPU: each MoE layer captured once; decode steps give the eager slot-table
    path's logits bit for bit (the same kernels), and transformers' greedy tokens."""
    from engine.moe.cuda_graphs import ExpertGraphs

    model, reference = _a_whole_q4_k_m_model(tmp_path, cuda)
    try:
        steps = []
        for graphs in (None, ExpertGraphs()):
            model.control.graphs = graphs
            kv = model.new_kv_cache()
            model.forward(torch.tensor(PROMPT), kv, logits_to_keep=1)
            steps.append(torch.cat([model.forward(torch.tensor([t]), kv) for t in (5, 9, 13, 2)]))
        torch.testing.assert_close(steps[1], steps[0], rtol=0, atol=1e-5)  # the same kernels
        assert graphs.off_because is None and graphs.captures == len(model.store.layer_indices)
        assert_matches_reference(model, reference, PROMPT)
        assert graphs.captures == len(model.store.layer_indices)  # replayed, never captured again
    finally:
        model.close()
