"""engine.gpu.int4_moe in Triton's interpreter (CPU tensors) against the torch reference:
`engine.formats.int4.dequantize` → `F.linear` → silu(gate) · up → Σ_k w_k · down_k(act_k), the
experts laid out by `int4_layout` (the int4 store's own) in a pool: GPTQ (v1 and v2, with and
without act-order's g_idx), AWQ, compressed-tensors (asymmetric with act-order, symmetric, one
group a row), float16 and bfloat16 scales.

The kernels compute `(q − z) · s` as the reference does: a one-hot x reads a column of the
reference weight bit for bit. Whole products are compared to 1e-6 of the output's largest value,
the reference's products summed in float64 (tests/engine/gpu/layout_pool.py says why).
"""

import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.formats.int4 import AWQ, CT, CT_SYM, GPTQ, GPTQ_V2, Int4Weight, dequantize, groups, packed_shapes
from engine.formats.int4_experts import int4_layout
from engine.gpu.projections import projection
from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter
from tests.engine.gpu.layout_pool import IDS, LayoutPool, assert_close, normal

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

HIDDEN, INTER = 320, 128  # 320: a partial chunk of 256 inputs
BLOCK_N = 64  # rows a program: the interpreter's time goes by ops, not by their size
# name → (format, group size (None: one group a row), act-order, scales' dtype)
CASES = {
    "gptq": (GPTQ, 64, False, torch.float16),
    "gptq-act-order": (GPTQ, 64, True, torch.float16),
    "gptq_v2": (GPTQ_V2, 32, False, torch.float16),
    "awq": (AWQ, 64, False, torch.float16),
    "ct-act-order": (CT, 32, True, torch.bfloat16),
    "ct-sym": (CT_SYM, 64, False, torch.bfloat16),
    "ct-sym-per-row": (CT_SYM, None, False, torch.float16),
}


def test_the_kernels_in_a_child_interpreter():
    """This module's tests, run by pytest in a process with TRITON_INTERPRET=1 from its start
    (tests/engine/gpu/interpreter.py says why)."""
    run_in_child_interpreter(__file__)


@pytest.fixture(scope="module")
def int4():
    """engine.gpu.int4_moe, imported in the child only (it imports triton)."""
    from engine.gpu import int4_moe

    return int4_moe


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(40)


def random_words(rng: np.random.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(rng.integers(-(2**31), 2**31, shape, dtype=np.int64).astype(np.int32))


def random_g_idx(rng: np.random.Generator, parts: int, inputs: int, group_size: int) -> torch.Tensor:
    """Act-order's groups: each stacked matrix's own permutation of `i // group_size`."""
    plain = np.arange(inputs) // group_size
    return torch.from_numpy(np.stack([rng.permutation(plain) for _ in range(parts)]).astype(np.int32))


def fill_weight(weight: Int4Weight, rng: np.random.Generator) -> None:
    """Random words and zeros (every nibble), scales of moderate size and, for act-order, groups."""
    weight.qweight.copy_(random_words(rng, tuple(weight.qweight.shape)))
    weight.qzeros.copy_(random_words(rng, tuple(weight.qzeros.shape)))
    scales = rng.random(tuple(weight.scales.shape)) * 0.02 + 1e-3
    weight.scales.copy_(torch.from_numpy(scales).to(weight.scales.dtype))
    if weight.g_idx is not None:
        inputs = weight.shape[1]
        weight.g_idx.copy_(random_g_idx(rng, weight.g_idx.shape[0], inputs, inputs // groups(weight)))


def fill(views, rng: np.random.Generator) -> None:
    for name in ("gate_up_proj", "down_proj"):
        fill_weight(views[name], rng)


def int4_pool(case: str, rng) -> LayoutPool:
    fmt, group_size, act_order, scales_dtype = CASES[case]
    fields = [
        (name, (rows, columns), fmt, columns // (group_size or columns), parts * act_order)
        for name, rows, columns, parts in (
            ("gate_up_proj", 2 * INTER, HIDDEN, 2),
            ("down_proj", HIDDEN, INTER, 1),
        )
    ]
    return LayoutPool(int4_layout(fields, scales_dtype), fill, dequantize, rng)


def one_matrix(case: str, shape: tuple[int, int], rng) -> Int4Weight:
    fmt, group_size, act_order, scales_dtype = CASES[case]
    count = shape[1] // (group_size or shape[1])
    packed = packed_shapes(fmt, shape, count)
    g_idx = torch.zeros(1, shape[1], dtype=torch.int32) if act_order else None
    qzeros, scales = (
        torch.zeros(packed["qzeros"], dtype=torch.int32),
        torch.zeros(packed["scales"], dtype=scales_dtype),
    )
    weight = Int4Weight(torch.zeros(packed["qweight"], dtype=torch.int32), qzeros, scales, g_idx, fmt, shape)
    fill_weight(weight, rng)
    return weight


@in_the_interpreter
@pytest.mark.parametrize("case", ["gptq-act-order", "awq", "ct-act-order"])
def test_a_one_hot_x_reads_the_reference_weight_bit_for_bit(int4, case, rng):
    weight = one_matrix(case, (40, HIDDEN), rng)
    want = dequantize(weight)
    for column in (0, 7, 31, 64, 129, 255, 256, 319):
        x = torch.zeros(HIDDEN)
        x[column] = 1.0
        assert torch.equal(int4.quantized_gemv(x, weight), want[:, column]), column


@in_the_interpreter
@pytest.mark.parametrize("case", CASES)
def test_quantized_gemv_is_f_linear_on_dequantize(int4, case, rng):
    weight = one_matrix(case, (72, HIDDEN), rng)
    x = normal(rng, HIDDEN)
    assert_close(int4.quantized_gemv(x, weight), F.linear(x.double(), dequantize(weight).double()))


@in_the_interpreter
@pytest.mark.parametrize("case", CASES)
def test_gate_up_is_silu_gate_times_up_of_each_routed_expert(int4, case, rng):
    pool = int4_pool(case, rng)
    x = normal(rng, HIDDEN)
    act = pool.gate_up_act(int4, x, IDS, BLOCK_N)
    assert_close(act, pool.reference_act(x, IDS))
    assert torch.equal(act[0], act[2])  # the same expert twice: the same values


@in_the_interpreter
@pytest.mark.parametrize("case", CASES)
def test_down_is_the_weighted_sum_over_the_routed_experts(int4, case, rng):
    pool = int4_pool(case, rng)
    act = normal(rng, len(IDS), INTER)
    weights = torch.tensor([0.5, 0.3, 0.2])
    assert_close(pool.down_out(int4, act, IDS, weights, BLOCK_N), pool.reference_out(act, IDS, weights))


@in_the_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_whole_step_matches_the_reference(int4, dtype, rng):
    """x `[1, H]` and the routing weights in the model's dtype, int32 slot table and ids, the
    built kernels' 8 rows a program."""
    pool = int4_pool("gptq-act-order", rng)
    pool.table = pool.table.int()
    ids = [5, 0, 2]
    x = normal(rng, 1, HIDDEN).to(dtype)
    weights = torch.tensor([0.6, 0.25, 0.15], dtype=dtype)
    out = pool.down_out(int4, pool.gate_up_act(int4, x, ids, 8), ids, weights, 8)
    assert_close(out, pool.reference_out(pool.reference_act(x, ids), ids, weights))


@pytest.mark.parametrize(
    ("group_size", "scales_dtype", "reason"),
    [(16, torch.float16, "groups are 16 inputs"), (64, torch.float32, "scales are torch.float32")],
)
def test_what_the_kernels_do_not_read_is_declined(group_size, scales_dtype, reason):
    fields = [("gate_up_proj", (2 * INTER, HIDDEN), GPTQ, HIDDEN // group_size, 0)]
    found = projection(int4_layout(fields, scales_dtype), "gate_up_proj")
    assert isinstance(found, str) and reason in found, found
