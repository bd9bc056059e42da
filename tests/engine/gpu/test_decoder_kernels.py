"""engine.gpu.decoder_kernels in Triton's interpreter (CPU tensors) against transformers' modules:
Qwen3-MoE's RMSNorm, `apply_rotary_pos_emb` and top-k router.

Bit for bit where the kernel runs the reference's operations in its order and rounding: the
residual sum, the rotary (each product and sum rounded to the dtype, as torch's operators), the
norm where the sum of squares is exact (small integers: any order gives it). Elsewhere the sum
of squares (and the softmax's exp and sum) run in another order than torch's: float32 within 1e-6
of the output's largest value, bfloat16 within one step of its 8 bits (2⁻⁷ of the largest value)
on the few values where a float32 difference crosses a rounding boundary.
"""

import importlib.util

import pytest
import torch
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeRMSNorm,
    Qwen3MoeTopKRouter,
    apply_rotary_pos_emb,
)

from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

RTOL = 1e-6
BF16_STEP = 2.0**-7  # the spacing of bfloat16 values relative to their size, at most
EPS = 1e-6
HEADS, KV_HEADS, HEAD_DIM, CAPACITY, POSITIONS = 8, 2, 128, 48, 64
DTYPES = [torch.float32, torch.bfloat16]


def test_the_kernels_in_a_child_interpreter():
    """This module's tests, run by pytest in a process with TRITON_INTERPRET=1 from its start
    (tests/engine/gpu/interpreter.py says why)."""
    run_in_child_interpreter(__file__)


@pytest.fixture(scope="module")
def dk():
    """engine.gpu.decoder_kernels, imported in the child only (it imports triton)."""
    from engine.gpu import decoder_kernels

    return decoder_kernels


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(40)


def randn(*shape: int, generator: torch.Generator, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: within RTOL of the largest value; bfloat16: within a step of it, on few values."""
    assert got.dtype == want.dtype and got.shape == want.shape
    error, scale = (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()
    if got.dtype == torch.float32:
        assert error <= RTOL * scale, f"max |Δ| {error:.3g} > {RTOL:g} · max |ref| {scale:.3g}"
    else:
        assert error <= BF16_STEP * scale, f"max |Δ| {error:.3g} > a bfloat16 step of {scale:.3g}"
        assert (got != want).float().mean() < 0.01


def llama_norm(width: int, dtype: torch.dtype, generator: torch.Generator) -> Qwen3MoeRMSNorm:
    norm = Qwen3MoeRMSNorm(width, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(width, generator=generator) + 1)
    return norm


@in_the_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [2048, 3000])  # two blocks; a part-block
def test_add_rms_norm_adds_in_place_and_norms_as_llama_does(dk, dtype, width, generator):
    norm = llama_norm(width, dtype, generator)
    x, residual = (
        randn(2, width, generator=generator, dtype=dtype),
        randn(2, width, generator=generator, dtype=dtype),
    )
    want_residual = residual + x
    with torch.no_grad():
        want = norm(want_residual)
    out = dk.add_rms_norm(x, residual, norm.weight.detach(), EPS)
    assert torch.equal(residual, want_residual)
    assert_close(out, want)


@in_the_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("add", [True, False], ids=["add", "plain"])
def test_the_norm_is_bit_exact_where_the_sum_of_squares_is(dk, dtype, add, generator):
    """Small integers: their squares and sums are exact in any order, so the rest of the norm (the
    mean's division, the square root, the reciprocal, the roundings) meets torch's bit for bit."""
    width = 4096
    norm = llama_norm(width, dtype, generator)
    ints = torch.randint(-8, 9, (3, width), generator=generator)
    x, residual = ints.to(dtype), torch.randint(-8, 9, (3, width), generator=generator).to(dtype)
    with torch.no_grad():
        want = norm(residual + x if add else x)
    weight = norm.weight.detach()
    out = dk.add_rms_norm(x, residual, weight, EPS) if add else dk.rms_norm(x, weight, EPS)
    assert torch.equal(out, want)


@in_the_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_norms_each_head_as_a_row(dk, dtype, generator):
    """Qwen3's q/k norms through the plain norm: rows = heads, width = head_dim."""
    norm = llama_norm(HEAD_DIM, dtype, generator)
    heads = randn(HEADS, HEAD_DIM, generator=generator, dtype=dtype) * 3
    with torch.no_grad():
        want = norm(heads)
    assert_close(dk.rms_norm(heads, norm.weight.detach(), EPS), want)


@in_the_interpreter
def test_a_float32_weight_on_bfloat16_rows_gives_float32_as_torch_does(dk, generator):
    norm = llama_norm(256, torch.float32, generator)
    x = randn(2, 256, generator=generator, dtype=torch.bfloat16)
    with torch.no_grad():
        want = norm(x)
    out = dk.rms_norm(x, norm.weight.detach(), EPS)
    assert out.dtype == want.dtype == torch.float32
    assert_close(out, want)


def rotary_tables(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[POSITIONS, D]` as transformers' default rotary module builds them."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    angles = torch.outer(torch.arange(POSITIONS, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Heads:
    """One token's q, k, v per head, the rotary tables, empty caches; the reference's results."""

    def __init__(self, dtype: torch.dtype, generator: torch.Generator, integers: bool = False):
        def draw(*shape):
            if integers:  # the norms' sums of squares exact
                return torch.randint(-8, 9, shape, generator=generator).to(dtype)
            return randn(*shape, generator=generator, dtype=dtype)

        self.q, self.k, self.v = draw(HEADS, HEAD_DIM), draw(KV_HEADS, HEAD_DIM), draw(KV_HEADS, HEAD_DIM)
        self.cos, self.sin = rotary_tables(dtype)
        self.keys = torch.full((1, KV_HEADS, CAPACITY, HEAD_DIM), 7.0, dtype=dtype)  # 7: never written
        self.values = self.keys.clone()
        self.q_norm, self.k_norm = (
            llama_norm(HEAD_DIM, dtype, generator),
            llama_norm(HEAD_DIM, dtype, generator),
        )

    def run(self, dk, position: int, norms: bool) -> torch.Tensor:
        weights = (self.q_norm.weight.detach(), self.k_norm.weight.detach()) if norms else (None, None)
        pos = torch.tensor(position)
        return dk.rope_kv_write(
            self.q, self.k, self.v, self.cos, self.sin, pos, self.keys, self.values, *weights, EPS
        )

    def reference(self, position: int, norms: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' q and k `[heads, D]`: normed per head where asked, then rotated."""
        q, k = self.q, self.k
        if norms:
            with torch.no_grad():
                q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.cos[position][None], self.sin[position][None]  # [1, D]: one position
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)  # [1, heads, D]
        return q[0], k[0]


@in_the_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("position", [0, 17, CAPACITY - 1])
def test_rope_kv_write_rotates_as_transformers_and_writes_one_cache_row(dk, dtype, position, generator):
    heads = Heads(dtype, generator)
    q_out = heads.run(dk, position, norms=False)
    want_q, want_k = heads.reference(position, norms=False)
    assert torch.equal(q_out, want_q)  # the same operations, rounded alike: bit for bit
    assert torch.equal(heads.keys[0, :, position], want_k)
    assert torch.equal(heads.values[0, :, position], heads.v)
    others = torch.arange(CAPACITY) != position
    assert (heads.keys[:, :, others] == 7).all() and (heads.values[:, :, others] == 7).all()


@in_the_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_kv_write_norms_each_head_first_as_qwen3_does(dk, dtype, generator):
    heads = Heads(dtype, generator)
    q_out = heads.run(dk, 5, norms=True)
    want_q, want_k = heads.reference(5, norms=True)
    assert_close(q_out, want_q)
    assert_close(heads.keys[0, :, 5], want_k)


@in_the_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_kv_write_with_norms_is_bit_exact_where_the_sums_are(dk, dtype, generator):
    heads = Heads(dtype, generator, integers=True)
    q_out = heads.run(dk, 30, norms=True)
    want_q, want_k = heads.reference(30, norms=True)
    assert torch.equal(q_out, want_q) and torch.equal(heads.keys[0, :, 30], want_k)


@in_the_interpreter
def test_positions_past_the_buffers_touch_nothing_outside_them(dk, generator):
    """A position past the capacity writes no cache row; past the table it reads the last row."""
    heads = Heads(torch.float32, generator)
    before = heads.keys.clone(), heads.values.clone()
    heads.run(dk, CAPACITY, norms=False)
    assert torch.equal(heads.keys, before[0]) and torch.equal(heads.values, before[1])
    assert torch.equal(
        heads.run(dk, POSITIONS + 5, norms=False), heads.reference(POSITIONS - 1, norms=False)[0]
    )


def qwen3_router(
    experts: int, top_k: int, renormalize: bool, generator: torch.Generator
) -> Qwen3MoeTopKRouter:
    config = Qwen3MoeConfig(hidden_size=64, num_experts=experts, num_experts_per_tok=top_k)
    config.norm_topk_prob = renormalize
    router = Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(randn(experts, 64, generator=generator))
    return router


@in_the_interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("experts", "top_k", "renormalize"), [(128, 8, True), (128, 8, False), (60, 4, False), (512, 16, True)]
)
def test_router_top_k_is_qwen3_moe_s_router(dk, dtype, experts, top_k, renormalize, generator):
    """Softmax in float32, top-k, renormalized where norm_topk_prob, cast (Mixtral's router is the
    renormalized one); three tokens."""
    router = qwen3_router(experts, top_k, renormalize, generator).to(dtype)
    with torch.no_grad():
        logits, want_weights, want_ids = router(randn(3, 64, generator=generator, dtype=dtype))
    ids, weights = dk.router_top_k(logits, top_k, renormalize)
    assert ids.dtype == torch.int64
    assert_same_route(ids, want_ids, torch.softmax(logits.float(), -1))
    assert_close(weights, want_weights)


def assert_same_route(ids: torch.Tensor, want_ids: torch.Tensor, probs: torch.Tensor) -> None:
    """The same experts where no two share a probability; among equal ones (bfloat16 logits have 8
    bits: 512 of them hold ties) the same probabilities at each place, the lowest expert first."""
    got, want = probs.gather(-1, ids), probs.gather(-1, want_ids)
    assert torch.equal(got, want)
    tied = (probs[..., None, :] == got[..., None]).sum(-1) > 1  # [T, K]: the expert's probability is shared
    assert torch.equal(ids[~tied], want_ids[~tied])
    same_as_next = got[..., 1:] == got[..., :-1]
    assert (ids[..., 1:] > ids[..., :-1])[same_as_next].all()


@in_the_interpreter
def test_router_top_k_takes_one_token_s_logits_alone(dk, generator):
    logits = randn(64, generator=generator)
    ids, weights = dk.router_top_k(logits, 4, True)
    probs = torch.softmax(logits, -1)
    want_weights, want_ids = torch.topk(probs, 4)
    assert ids.shape == (4,) and torch.equal(ids, want_ids)
    assert_close(weights, want_weights / want_weights.sum())


@in_the_interpreter
def test_among_equal_probabilities_the_lowest_expert_comes_first(dk):
    """torch.topk on the CPU orders ties as it likes; the kernel by expert, lowest first."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, 0.5, 1.0, 0.0]])
    ids, weights = dk.router_top_k(logits, 5, False)
    assert ids.tolist() == [[1, 3, 4, 2, 6]]
    assert torch.equal(weights, torch.topk(torch.softmax(logits, -1), 5).values)


@in_the_interpreter
def test_wrong_arguments_are_refused_with_a_reason(dk, generator):
    heads = Heads(torch.float32, generator)
    pos = torch.tensor(3)
    q, k, v, keys, values = heads.q, heads.k, heads.v, heads.keys, heads.values

    def rope(q=q, cos=heads.cos, pos=pos, q_norm=None):
        return dk.rope_kv_write(q, k, v, cos, heads.sin, pos, keys, values, q_norm)

    cases = [
        (lambda: dk.router_top_k(torch.zeros(2, 513), 8, True), "E ≤ 512"),
        (lambda: dk.router_top_k(torch.zeros(2, 64), 17, True), "top_k"),
        (lambda: dk.rms_norm(torch.zeros(2, 64), torch.ones(32), EPS), "weight"),
        (
            lambda: dk.add_rms_norm(torch.zeros(2, 64), torch.zeros(64, 2).t(), torch.ones(64), EPS),
            "residual",
        ),
        (lambda: rope(cos=heads.cos[:, :64]), "cos"),
        (lambda: rope(pos=pos.float()), "pos"),
        (lambda: rope(q_norm=torch.ones(HEAD_DIM)), "together"),
        (lambda: rope(q=q[:, :96].contiguous()), "power of two"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
