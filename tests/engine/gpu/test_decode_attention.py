"""engine.gpu.decode_attention in Triton's interpreter (CPU tensors) against transformers'
`eager_attention_forward` (Qwen3-MoE's) on the cache's first pos + 1 positions.

The reference runs in float64 on the same values: in float32 it is itself about 1e-6 of the
output's largest value away from exact (a score's float32 rounding, which exp scales into the
weights), as far as the kernel is from it. The kernel sums the products, the exponentials and the
weighted values in float32 in another order (in splits, then across them): within 1e-6 of the
output's largest value. bfloat16 caches: the kernel computes in float32 and rounds once, so within
half a bfloat16 step (2⁻⁸ of the largest value) more. The interpreter multiplies in float32 where
the GPU uses tensor cores (the module doc says how).
"""

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import eager_attention_forward

from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

RTOL = 1e-6
HEAD_DIM, CAPACITY = 128, 300  # 3 splits of 128 positions, the last one part-filled
SCALING = HEAD_DIM**-0.5


def test_the_kernels_in_a_child_interpreter():
    """This module's tests, run by pytest in a process with TRITON_INTERPRET=1 from its start
    (tests/engine/gpu/interpreter.py says why)."""
    run_in_child_interpreter(__file__)


@pytest.fixture(scope="module")
def da():
    """engine.gpu.decode_attention, imported in the child only (it imports triton)."""
    from engine.gpu import decode_attention

    return decode_attention


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(40)


class Cache:
    """A layer's static KV cache `[1, kv_heads, CAPACITY, D]` and a query `[heads, D]`."""

    def __init__(self, heads: int, kv_heads: int, generator: torch.Generator, dtype=torch.float32):
        self.heads, self.kv_heads = heads, kv_heads
        shape = (1, kv_heads, CAPACITY, HEAD_DIM)
        self.keys = torch.randn(shape, generator=generator).to(dtype)
        self.values = torch.randn(shape, generator=generator).to(dtype)
        self.q = (torch.randn(heads, HEAD_DIM, generator=generator) * 2).to(dtype)

    def reference(self, position: int) -> torch.Tensor:
        """transformers' eager attention of the query over positions 0 … position, in float64."""
        module = SimpleNamespace(num_key_value_groups=self.heads // self.kv_heads, training=False)
        length = position + 1
        keys, values = (c[:, :, :length].double() for c in (self.keys, self.values))
        query = self.q.double()[None, :, None]  # [1, heads, 1, D]
        out, _ = eager_attention_forward(module, query, keys, values, None, scaling=SCALING)
        return out.reshape(self.heads, HEAD_DIM)  # [1, 1, heads, D]: o_proj's rows

    def attend(self, da, position: int, **given) -> torch.Tensor:
        return da.decode_attention(self.q, self.keys, self.values, torch.tensor(position), SCALING, **given)


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    assert got.shape == want.shape
    error, scale = (got.double() - want).abs().max().item(), want.abs().max().item()
    assert error <= rtol * scale, f"max |Δ| {error:.3g} > {rtol:g} · max |ref| {scale:.3g}"


@in_the_interpreter
@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(4, 4), (8, 2), (16, 2), (16, 1), (40, 2)], ids=lambda n: str(n)
)  # groups of 1, 4, 8, 16 and 20 (two programs a KV head)
@pytest.mark.parametrize("position", [0, 127, 128, 200, CAPACITY - 1])  # split boundaries, the last
def test_attention_is_transformers_eager_attention_over_the_first_positions(
    da, heads, kv_heads, position, generator
):
    cache = Cache(heads, kv_heads, generator)
    assert_close(cache.attend(da, position), cache.reference(position))


@in_the_interpreter
def test_positions_past_pos_are_never_read(da, generator):
    cache = Cache(8, 2, generator)
    want = cache.reference(150)
    cache.keys[:, :, 151:] = float("nan")
    cache.values[:, :, 151:] = float("nan")
    assert_close(cache.attend(da, 150), want)


@in_the_interpreter
def test_one_workspace_serves_every_position_as_a_replayed_graph_would(da, generator):
    """The grid and the workspace come from the capacity; only the device position changes."""
    cache = Cache(8, 2, generator)
    workspace = da.attention_workspace(8, CAPACITY, HEAD_DIM, "cpu")
    out = torch.empty(8, HEAD_DIM)  # float32, as the query
    for position in (250, 3, 130, 299):
        assert cache.attend(da, position, out=out, workspace=workspace) is out
        assert_close(out, cache.reference(position))


@in_the_interpreter
def test_a_position_past_the_capacity_attends_to_the_whole_cache(da, generator):
    cache = Cache(8, 2, generator)
    assert_close(cache.attend(da, CAPACITY + 40), cache.reference(CAPACITY - 1))


@in_the_interpreter
@pytest.mark.parametrize("position", [0, 200])
def test_bfloat16_caches_are_attended_in_float32_and_rounded_once(da, position, generator):
    cache = Cache(16, 2, generator, torch.bfloat16)
    out = cache.attend(da, position)
    assert out.dtype == torch.bfloat16
    assert_close(out, cache.reference(position), rtol=2.0**-8 + RTOL)


@pytest.mark.parametrize("capacity", [1, 100, 128, 300, 4096, 8192, 40000, 131072])
def test_the_splits_cover_the_capacity_in_whole_blocks(capacity):
    from engine.gpu.registry import (
        ATTENTION_BLOCK_T,
        ATTENTION_MAX_SPLITS,
        MIN_SPLIT_POSITIONS,
        attention_splits,
    )

    splits, split_len = attention_splits(capacity)
    assert 1 <= splits <= ATTENTION_MAX_SPLITS and split_len % ATTENTION_BLOCK_T == 0
    assert split_len >= MIN_SPLIT_POSITIONS and (splits - 1) * split_len < capacity <= splits * split_len


@in_the_interpreter
def test_wrong_arguments_are_refused_with_a_reason(da, generator):
    cache = Cache(6, 4, generator)
    pos = torch.tensor(3)
    even = Cache(8, 2, generator)
    cases = [
        (lambda: cache.attend(da, 3), "evenly"),
        (lambda: da.decode_attention(even.q, even.keys, even.values, pos.float(), SCALING), "pos"),
        (lambda: da.decode_attention(even.q, even.keys, even.values.double(), pos, SCALING), "value_cache"),
        (lambda: da.decode_attention(even.q, even.keys[0], even.values, pos, SCALING), r"\[1, kv_heads"),
        (
            lambda: even.attend(da, 3, workspace=da.attention_workspace(8, 4096, HEAD_DIM, "cpu")),
            "workspace",
        ),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
