"""engine.gpu.fp8_moe in Triton's interpreter (CPU tensors) against the torch reference:
`engine.formats.fp8.dequantize` → `F.linear` → silu(gate) · up → Σ_k w_k · down_k(act_k), the experts
laid out by `fp8_layout` (the FP8 store's own) in a pool: 128 × 128 blocks (partial at the edges),
a scale a row, a scale a matrix.

The kernels decode e4m3 with integer operations and multiply by the block's scale as the reference
does: a one-hot x reads a column of the reference weight bit for bit, every byte value included
(subnormals, NaN). Whole products are compared to 1e-6 of the output's largest value, the
reference's products summed in float64 (tests/engine/gpu/layout_pool.py says why).
"""

import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.formats.fp8 import FP8_DTYPE, Fp8Weight, dequantize, scale_shape
from engine.formats.fp8_experts import fp8_layout
from engine.gpu.projections import projection
from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter
from tests.engine.gpu.layout_pool import IDS, LayoutPool, assert_close, normal

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

HIDDEN, INTER = 320, 192  # 320: a partial 128-column block, and a partial chunk of 256
BLOCK_N = 64  # rows a program: the interpreter's time goes by ops, not by their size
NAN_BYTES = (0x7F, 0xFF)
# (gate_up's block, down's block): 128 × 128 (partial at the edges), one scale a row, one a matrix
BLOCKS = {
    "block-128": ((128, 128), (128, 128)),
    "per-row": ((1, HIDDEN), (1, INTER)),
    "per-tensor": ((INTER, HIDDEN), (HIDDEN, INTER)),  # gate and up keep a scale each
}


def test_the_kernels_in_a_child_interpreter():
    """This module's tests, run by pytest in a process with TRITON_INTERPRET=1 from its start
    (tests/engine/gpu/interpreter.py says why)."""
    run_in_child_interpreter(__file__)


@pytest.fixture(scope="module")
def fp8():
    """engine.gpu.fp8_moe, imported in the child only (it imports triton)."""
    from engine.gpu import fp8_moe

    return fp8_moe


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(40)


def random_codes(rng: np.random.Generator, shape: tuple[int, int]) -> torch.Tensor:
    """Random e4m3 values `shape`, every byte but NaN's (subnormals too)."""
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes[np.isin(codes, NAN_BYTES)] = 0x3F
    return torch.from_numpy(codes).view(FP8_DTYPE)


def random_scales(rng: np.random.Generator, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy((rng.random(shape) * 0.02 + 1e-3).astype(np.float32))


def fill(views, rng: np.random.Generator) -> None:
    for name in ("gate_up_proj", "down_proj"):
        weight = views[name]
        weight.data.copy_(random_codes(rng, tuple(weight.data.shape)))
        weight.scale_inv.copy_(random_scales(rng, tuple(weight.scale_inv.shape)))


def fp8_pool(blocks: tuple[tuple[int, int], tuple[int, int]], rng) -> LayoutPool:
    layout = fp8_layout(
        [("gate_up_proj", (2 * INTER, HIDDEN), blocks[0]), ("down_proj", (HIDDEN, INTER), blocks[1])]
    )
    return LayoutPool(layout, fill, dequantize, rng)


@in_the_interpreter
def test_a_one_hot_x_reads_every_e4m3_value_bit_for_bit(fp8):
    """Each of the 256 bytes as a row's value, times a scale of one: torch's float8_e4m3fn float."""
    codes = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 64)
    weight = Fp8Weight(codes.view(FP8_DTYPE), torch.ones(1, 1), (256, 64))
    want = codes.view(FP8_DTYPE).float()
    for column in (0, 33, 63):
        x = torch.zeros(64)
        x[column] = 1.0
        got = fp8.quantized_gemv(x, weight)
        assert torch.equal(got.isnan(), want[:, column].isnan())
        assert torch.equal(got.nan_to_num(), want[:, column].nan_to_num()), column


@in_the_interpreter
@pytest.mark.parametrize("block", [(128, 128), (1, 300), (70, 300), (16, 64)], ids=str)
def test_quantized_gemv_is_f_linear_on_dequantize(fp8, block, rng):
    """70 × 300: partial blocks on both edges, a partial 32 of columns."""
    weight = Fp8Weight(random_codes(rng, (70, 300)), random_scales(rng, scale_shape((70, 300), block)), block)
    x = normal(rng, 300)
    assert_close(fp8.quantized_gemv(x, weight), F.linear(x.double(), dequantize(weight).double()))


@in_the_interpreter
@pytest.mark.parametrize("blocks", BLOCKS.values(), ids=BLOCKS.keys())
def test_gate_up_is_silu_gate_times_up_of_each_routed_expert(fp8, blocks, rng):
    pool = fp8_pool(blocks, rng)
    x = normal(rng, HIDDEN)
    act = pool.gate_up_act(fp8, x, IDS, BLOCK_N)
    assert_close(act, pool.reference_act(x, IDS))
    assert torch.equal(act[0], act[2])  # the same expert twice: the same values


@in_the_interpreter
@pytest.mark.parametrize("blocks", BLOCKS.values(), ids=BLOCKS.keys())
def test_down_is_the_weighted_sum_over_the_routed_experts(fp8, blocks, rng):
    pool = fp8_pool(blocks, rng)
    act = normal(rng, len(IDS), INTER)
    weights = torch.tensor([0.5, 0.3, 0.2])
    assert_close(pool.down_out(fp8, act, IDS, weights, BLOCK_N), pool.reference_out(act, IDS, weights))


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_whole_step_matches_the_reference(fp8, dtype, rng):
    """x `[1, H]` and the routing weights in the model's dtype, int32 slot table and ids, the
    built kernels' 8 rows a program."""
    pool = fp8_pool(BLOCKS["block-128"], rng)
    pool.table = pool.table.int()
    ids = [5, 0, 2]
    x = normal(rng, 1, HIDDEN).to(dtype)
    weights = torch.tensor([0.6, 0.25, 0.15], dtype=dtype)
    out = pool.down_out(fp8, pool.gate_up_act(fp8, x, ids, 8), ids, weights, 8)
    assert_close(out, pool.reference_out(pool.reference_act(x, ids), ids, weights))


@in_the_interpreter
def test_a_field_past_the_pool_row_is_refused(fp8, rng):
    pool = fp8_pool(BLOCKS["block-128"], rng)
    act, ids, weights = torch.zeros(3, INTER), torch.tensor(IDS), torch.ones(3)
    with pytest.raises(ValueError, match="do not fit"):
        fp8.moe_down(act, pool.pool[:, :-64].contiguous(), pool.table, ids, weights, pool.down)


def test_scale_blocks_narrower_than_32_columns_are_declined():
    layout = fp8_layout(
        [("gate_up_proj", (2 * INTER, HIDDEN), (1, 16)), ("down_proj", (HIDDEN, INTER), (1, 16))]
    )
    reason = projection(layout, "gate_up_proj")
    assert isinstance(reason, str) and "16 columns wide" in reason
