"""engine.gpu.kquant_moe in Triton's interpreter (CPU tensors) against the torch reference:
`gguf_blocks.dequantize` → `F.linear` in float32 → silu(gate) · up → Σ_k w_k · down_k(act_k).

The kernels dequantize each weight with the reference's float32 operations, so a one-hot x reads
a column of the reference weight bit for bit. Whole products are compared to a bound relative to
the output's largest value: the kernels and the BLAS matmul sum the same products in another
order (1e-7 to 2.5e-7 of the output here), and 1e-6 leaves room for that and nothing more.
"""

import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from engine.errors import UnsupportedQuantizationError
from engine.formats.gguf.blocks import dequantize
from engine.gpu.checks.experts import random_blocks
from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

HIDDEN, INTER, EXPERTS, SLOTS = 512, 256, 6, 8
IDS = [4, 1, 4]  # top-k with a repeat, their slots out of order
ALIGN = 64  # fields start on 64-byte boundaries, as ExpertLayout places them
RTOL = 1e-6
BLOCK_N = 64  # rows a program: the interpreter's time goes by ops, not by their size
# (gate_up, down): Q4_K_M files give down projections Q4_K or Q6_K, Q5_K_M ones Q5_K or Q6_K
TYPE_PAIRS = [
    (QT.Q4_K, QT.Q4_K),
    (QT.Q4_K, QT.Q6_K),
    (QT.Q6_K, QT.Q6_K),
    (QT.Q8_0, QT.Q8_0),
    (QT.Q5_K, QT.Q6_K),
    (QT.IQ4_XS, QT.IQ4_XS),
    (QT.IQ4_NL, QT.IQ4_NL),
    (QT.MXFP4, QT.MXFP4),
]
TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_0, QT.IQ4_XS, QT.IQ4_NL, QT.MXFP4]
PAIR_IDS = [f"{g.name}-{d.name}" for g, d in TYPE_PAIRS]


def test_the_kernels_in_a_child_interpreter():
    """This module's tests, run by pytest in a process with TRITON_INTERPRET=1 from its start
    (tests/engine/gpu/interpreter.py says why)."""
    run_in_child_interpreter(__file__)


@pytest.fixture(scope="module")
def kq():
    """engine.gpu.kquant_moe, imported in the child only (it imports triton)."""
    from engine.gpu import kquant_moe

    return kquant_moe


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Pool:
    """EXPERTS experts of one layer (gate_up `[2I, H]`, then down `[H, I]` at the next 64-byte
    boundary) in shuffled rows of a uint8 pool of SLOTS rows, other rows random bytes; its slot table."""

    def __init__(self, types: tuple[QT, QT], rng: np.random.Generator):
        self.gate_up_type, self.down_type = types
        self.gate_up = [random_blocks(self.gate_up_type, 2 * INTER, HIDDEN, rng) for _ in range(EXPERTS)]
        self.down = [random_blocks(self.down_type, HIDDEN, INTER, rng) for _ in range(EXPERTS)]
        self.down_offset = _aligned(self.gate_up[0].numel())
        nbytes = _aligned(self.down_offset + self.down[0].numel())
        self.pool = torch.from_numpy(rng.integers(0, 256, (SLOTS, nbytes), dtype=np.uint8))
        slots = rng.permutation(SLOTS)[:EXPERTS]
        for expert, slot in enumerate(slots):
            gate_up, down = self.gate_up[expert].reshape(-1), self.down[expert].reshape(-1)
            self.pool[slot, : len(gate_up)] = gate_up
            self.pool[slot, self.down_offset : self.down_offset + len(down)] = down
        self.table = torch.tensor(slots)  # int64, as ExpertCache.slot_table makes it

    def gate_up_act(self, kq, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
        ids = torch.tensor(ids)
        return kq.moe_gate_up(x, self.pool, self.table, ids, 0, self.gate_up_type, 2 * INTER, HIDDEN, BLOCK_N)

    def down_out(self, kq, act: torch.Tensor, ids: list[int], weights: torch.Tensor) -> torch.Tensor:
        ids = torch.tensor(ids)
        offset, kind = self.down_offset, self.down_type
        return kq.moe_down(act, self.pool, self.table, ids, weights, offset, kind, HIDDEN, INTER, BLOCK_N)

    def reference_act(self, x: torch.Tensor, ids: list[int]) -> torch.Tensor:
        acts = []
        for expert in ids:
            weight = dequantize(self.gate_up[expert], self.gate_up_type, (2 * INTER, HIDDEN), torch.float32)
            gate, up = F.linear(x.float().reshape(-1), weight).chunk(2)  # transformers' _default_apply_gate
            acts.append(F.silu(gate) * up)
        return torch.stack(acts)  # [K, I]

    def reference_out(self, act: torch.Tensor, ids: list[int], weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(HIDDEN)
        for k, expert in enumerate(ids):
            weight = dequantize(self.down[expert], self.down_type, (HIDDEN, INTER), torch.float32)
            out += weights[k].float() * F.linear(act[k], weight)
        return out


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    error, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert error <= rtol * scale, f"max |Δ| {error:.3g} > {rtol:g} · max |ref| {scale:.3g}"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(40)


@in_the_interpreter
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_one_hot_x_reads_the_reference_weight_bit_for_bit(kq, ggml_type, rng):
    rows, columns = 12, 512
    blocks = random_blocks(ggml_type, rows, columns, rng)
    weight = dequantize(blocks, ggml_type, (rows, columns), torch.float32)
    for column in (0, 31, 32, 70, 100, 129, 166, 200, 255, 256, 383, 511):  # every kind of sub-block
        x = torch.zeros(columns)
        x[column] = 1.0
        assert torch.equal(kq.quantized_gemv(x, blocks, ggml_type, rows, columns), weight[:, column]), column


@in_the_interpreter
@pytest.mark.parametrize(
    ("ggml_type", "rows", "columns"),
    [
        (QT.Q4_K, 100, 512),
        (QT.Q5_K, 70, 768),
        (QT.Q6_K, 37, 768),
        (QT.IQ4_XS, 45, 512),
        (QT.Q8_0, 45, 320),  # spare rows; blocks of 32 in part-chunks
        (QT.IQ4_NL, 45, 320),
        (QT.MXFP4, 45, 352),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_quantized_gemv_is_f_linear_on_dequantize(kq, ggml_type, rows, columns, rng):
    blocks = random_blocks(ggml_type, rows, columns, rng)
    x = torch.from_numpy(rng.standard_normal(columns).astype(np.float32))
    want = F.linear(x, dequantize(blocks, ggml_type, (rows, columns), torch.float32))
    assert_close(kq.quantized_gemv(x, blocks, ggml_type, rows, columns), want)


@in_the_interpreter
@pytest.mark.parametrize("types", TYPE_PAIRS, ids=PAIR_IDS)
def test_gate_up_is_silu_gate_times_up_of_each_routed_expert(kq, types, rng):
    pool = Pool(types, rng)
    x = torch.from_numpy(rng.standard_normal(HIDDEN).astype(np.float32))
    act = pool.gate_up_act(kq, x, IDS)
    assert_close(act, pool.reference_act(x, IDS))
    assert torch.equal(act[0], act[2])  # the same expert twice: the same values


@in_the_interpreter
def test_int32_slot_tables_and_ids_read_the_same_experts(kq, rng):
    pool = Pool((QT.Q4_K, QT.Q4_K), rng)
    x = torch.from_numpy(rng.standard_normal(HIDDEN).astype(np.float32))
    want = pool.gate_up_act(kq, x, IDS)
    pool.table = pool.table.int()
    ids = torch.tensor(IDS, dtype=torch.int32)
    got = kq.moe_gate_up(x, pool.pool, pool.table, ids, 0, QT.Q4_K, 2 * INTER, HIDDEN, BLOCK_N)
    assert torch.equal(got, want)


@in_the_interpreter
@pytest.mark.parametrize("types", TYPE_PAIRS, ids=PAIR_IDS)
def test_down_is_the_weighted_sum_over_the_routed_experts(kq, types, rng):
    pool = Pool(types, rng)
    act = torch.from_numpy(rng.standard_normal((len(IDS), INTER)).astype(np.float32))
    weights = torch.tensor([0.5, 0.3, 0.2])
    assert_close(pool.down_out(kq, act, IDS, weights), pool.reference_out(act, IDS, weights))


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_whole_step_matches_the_reference(kq, dtype, rng):
    """x `[1, H]` and the routing weights in the model's dtype (read as float32 by both)."""
    pool = Pool((QT.Q4_K, QT.Q6_K), rng)
    ids = [5, 0, 2]
    x = torch.from_numpy(rng.standard_normal((1, HIDDEN)).astype(np.float32)).to(dtype)
    weights = torch.tensor([0.6, 0.25, 0.15], dtype=dtype)
    out = pool.down_out(kq, pool.gate_up_act(kq, x, ids), ids, weights)
    assert_close(out, pool.reference_out(pool.reference_act(x, ids), ids, weights))


@in_the_interpreter
def test_gates_far_below_zero_give_zero_activations(kq, rng):
    """silu(g) for g below −88 (exp(−g) past float32's range): −0 in torch, g · 6e-39 here."""
    pool = Pool((QT.Q8_0, QT.Q8_0), rng)
    x = torch.from_numpy(rng.standard_normal(HIDDEN).astype(np.float32)) * 1e4
    want = pool.reference_act(x, IDS)
    assert (want == 0).any()  # the case is exercised: gates whose exp(−g) overflows
    assert_close(pool.gate_up_act(kq, x, IDS), want)


@in_the_interpreter
def test_types_without_a_kernel_are_refused(kq, rng):
    blocks = random_blocks(QT.Q3_K, 4, 256, rng)
    with pytest.raises(UnsupportedQuantizationError, match=r"read Q4_K, Q5_K, .* and MXFP4 blocks, not Q3_K"):
        kq.quantized_gemv(torch.zeros(256), blocks, QT.Q3_K, 4, 256)


@in_the_interpreter
def test_a_field_past_the_pool_row_or_off_its_alignment_is_refused(kq, rng):
    pool = Pool((QT.Q4_K, QT.Q4_K), rng)
    act, ids, weights = torch.zeros(3, INTER), torch.tensor(IDS), torch.ones(3)
    for offset, message in ((pool.down_offset + ALIGN, "do not fit"), (pool.down_offset - 8, "boundaries")):
        with pytest.raises(ValueError, match=message):
            kq.moe_down(act, pool.pool, pool.table, ids, weights, offset, QT.Q4_K, HIDDEN, INTER)
