"""`--kernels ggml`: GGUF experts and resident matrices on the CPU computed by llama.cpp's own
kernels (ggml, from the optional llama-cpp-python), on the file's blocks where they lie.

ggml quantizes the activations to 8 bits per block, as llama.cpp does, so its product is close to
the dequantized weight's (about a percent of the output's scale), not equal; the default exact
kernels are untouched. Without llama-cpp-python the option is refused by name."""

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import InvalidConfigError, InvalidRequestError
from engine.formats.gguf.blocks import dequantize
from engine.formats.gguf.repack import GGML, GGML_X8
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.ggml import kernels as ggml_kernels
from engine.ggml import library as ggml_library
from engine.ggml.interleave import interleaves
from engine.loader import load_model
from engine.moe.layer import OffloadedExperts
from engine.resident.ggml_linear import GgmlLinear
from engine.tiny.gguf_writer import write_tiny_gguf
from engine.tiny.kquant_encode import quantize

OUT, IN = 96, 512
PROMPT = [3, 17, 42, 99, 7, 250, 11, 64]
needs_ggml = pytest.mark.skipif(not ggml_library.available()[0], reason="llama-cpp-python is not installed")


def _weight(ggml_type: QT) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(3)
    dense = rng.standard_normal((OUT, IN)).astype(np.float32) * rng.uniform(0.01, 2.0, (OUT, 1))
    blocks = torch.from_numpy(quantize(dense, ggml_type)).view(torch.uint8).reshape(OUT, -1).clone()
    return blocks, dequantize(blocks, ggml_type, (OUT, IN), torch.float32)


@needs_ggml
@pytest.mark.parametrize("ggml_type", [QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q4_0])
@pytest.mark.parametrize("tokens", [1, 5])
def test_ggml_products_are_the_dequantized_products_to_8_bit_activation_precision(ggml_type, tokens):
    blocks, weight = _weight(ggml_type)
    x = torch.randn(tokens, IN, generator=torch.Generator().manual_seed(tokens))
    expected = x @ weight.T
    got = ggml_kernels.linear(x, blocks, ggml_type, OUT, IN)
    assert got.shape == (tokens, OUT) and got.dtype == torch.float32
    error = (got - expected).abs().max() / expected.abs().max()
    assert 0 < error < 0.02  # close, and not the exact product: llama.cpp's numerics
    bf16 = ggml_kernels.linear(x.to(torch.bfloat16), blocks, ggml_type, OUT, IN)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), got, rtol=0.02, atol=0.02 * expected.abs().max().item())


@needs_ggml
@pytest.mark.parametrize("tokens", [1, 5])
def test_bfloat16_weights_give_the_float32_sums_of_bfloat16_products(tokens):
    """ggml's bfloat16 kernel rounds the activations to bfloat16 (a bfloat16 model's already are) and
    sums in float32, as torch's bfloat16 matmul does: the same product up to the order of the sums."""
    weight = (torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)) / 8).to(torch.bfloat16)
    blocks = weight.view(torch.uint8).reshape(OUT, -1)  # a BF16 row as GGUF stores it: 2 bytes a weight
    x = torch.randn(tokens, IN, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    got = ggml_kernels.linear(x.float(), blocks, QT.BF16, OUT, IN)
    torch.testing.assert_close(got, x.float() @ weight.float().T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ggml_kernels.linear(x, blocks, QT.BF16, OUT, IN), x @ weight.T)


@needs_ggml
def test_unaligned_inputs_and_blocks_compute_and_bad_shapes_are_value_errors_not_aborts():
    blocks, weight = _weight(QT.Q4_K)
    padded = torch.empty(blocks.numel() + 3, dtype=torch.uint8)
    unaligned = padded[3:].view(OUT, -1)  # a slot's field need not start on ggml's 32-byte alignment
    unaligned.copy_(blocks)
    rows = torch.randn(4, IN + 1)[:, 1:]  # a strided view of activations
    expected = rows @ weight.T
    got = ggml_kernels.linear(rows, unaligned, QT.Q4_K, OUT, IN)
    assert (got - expected).abs().max() / expected.abs().max() < 0.02
    with pytest.raises(ValueError, match="bytes do not hold"):
        ggml_kernels.linear(rows, blocks[:-1], QT.Q4_K, OUT, IN)
    with pytest.raises(ValueError, match="cannot multiply"):
        ggml_kernels.linear(torch.randn(1, 500), blocks, QT.Q4_K, OUT, 500)


@needs_ggml
@pytest.mark.parametrize("ggml_type", [QT.Q4_K, QT.BF16])
def test_routed_products_are_each_experts_product_bit_for_bit(ggml_type):
    """`linear_routed` (one ggml_mul_mat_id node over a layer's packed experts) gives, for every
    token and route, the very value `linear` gives for that expert alone; a bad route or field is a
    ValueError, not an abort."""
    experts, top_k, offset = 5, 2, 40  # a field at an unaligned offset inside each expert's bytes
    rng = np.random.default_rng(0)
    weights = [quantize(rng.standard_normal((OUT, IN)).astype(np.float32), ggml_type) for _ in range(experts)]
    nbytes = weights[0].nbytes
    layer = torch.zeros(experts, offset + nbytes + 24, dtype=torch.uint8)
    for e, weight in enumerate(weights):
        layer[e, offset : offset + nbytes] = torch.from_numpy(weight.view(np.uint8).reshape(-1))
    field = (offset, int(ggml_type), OUT, IN)
    ids = [[1, 4], [0, 3], [4, 1]]
    for x in (torch.randn(3, IN), torch.randn(3, top_k, IN)):  # a row per token, or per route
        got = ggml_kernels.linear_routed(x, layer, field, ids)
        assert got.shape == (3, top_k, OUT)
        for t, k in np.ndindex(3, top_k):
            blocks = layer[ids[t][k], offset : offset + nbytes].reshape(OUT, -1).contiguous()
            row = x[t : t + 1] if x.dim() == 2 else x[t, k : k + 1]
            assert torch.equal(got[t, k], ggml_kernels.linear(row, blocks, ggml_type, OUT, IN)[0])
    with pytest.raises(ValueError, match=r"outside 0\.\.4"):
        ggml_kernels.linear_routed(torch.randn(3, IN), layer, field, [[1, 5], [0, 3], [4, 1]])
    with pytest.raises(ValueError, match="overruns"):
        ggml_kernels.linear_routed(torch.randn(3, IN), layer, (offset + 30, int(ggml_type), OUT, IN), ids)
    with pytest.raises(ValueError, match="do not fit 3×2 routes"):
        ggml_kernels.linear_routed(torch.randn(2, IN), layer, field, ids)


@needs_ggml
def test_a_routed_swiglu_is_its_two_routed_products_with_silu_between():
    """`routed_swiglu` (gate/up, SwiGLU and down in one ggml graph) gives what `linear_routed`,
    torch's `silu(gate) · up` and `linear_routed` give in turn, to ggml's float rounding of silu; a
    token's values do not depend on the batch; mismatched widths are a ValueError."""
    experts, inter, hidden = 4, 64, 256
    rng = np.random.default_rng(5)
    gate_up = [
        quantize(rng.standard_normal((2 * inter, hidden)).astype(np.float32), QT.Q4_K) for _ in range(experts)
    ]
    down = [
        quantize(rng.standard_normal((hidden, inter)).astype(np.float32), QT.Q8_0) for _ in range(experts)
    ]
    split = gate_up[0].nbytes
    layer = torch.zeros(experts, split + down[0].nbytes, dtype=torch.uint8)
    for e in range(experts):
        layer[e, :split] = torch.from_numpy(gate_up[e].view(np.uint8).reshape(-1))
        layer[e, split:] = torch.from_numpy(down[e].view(np.uint8).reshape(-1))
    fields = (0, int(QT.Q4_K), 2 * inter, hidden), (split, int(QT.Q8_0), hidden, inter)
    ids, x = [[0, 3], [2, 1], [3, 2]], torch.randn(3, hidden)
    got = ggml_kernels.routed_swiglu(x, layer, *fields, ids)
    gate, up = ggml_kernels.linear_routed(x, layer, fields[0], ids).chunk(2, dim=-1)
    want = ggml_kernels.linear_routed(torch.nn.functional.silu(gate) * up, layer, fields[1], ids)
    assert got.shape == (3, 2, hidden)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert torch.equal(ggml_kernels.routed_swiglu(x[1:2], layer, *fields, ids[1:2])[0], got[1])
    per_route = x[:, None, :].expand(3, 2, hidden).contiguous()  # a row per route, as Llama 4 has
    assert torch.equal(ggml_kernels.routed_swiglu(per_route, layer, *fields, ids), got)
    with pytest.raises(ValueError, match="do not feed"):
        ggml_kernels.routed_swiglu(x, layer, (0, int(QT.Q4_K), inter, hidden), fields[1], ids)


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ggml-kernels")
    return write_tiny_gguf(folder, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q8_0)


def _config(kernels: str) -> OffloadConfig:
    return OffloadConfig(
        device="cpu", dtype="bfloat16", expert_budget=ExpertBudget.parse("all"), kernels=kernels
    )


@needs_ggml
def test_a_gguf_model_with_ggml_kernels_keeps_the_files_blocks_and_stays_close_to_exact(tiny_q4_k_m):
    logits = {}
    for kernels in ("exact", "ggml"):
        model = load_model(tiny_q4_k_m, _config(kernels))
        try:
            fields = {f.name: f for f in model.store.layout_of(0).fields}
            kept = [name for name, m in model.hf_model.named_modules() if isinstance(m, GgmlLinear)]
            if kernels == "exact":
                assert not kept
            else:
                # used in place: Q4_K gate/up rows interleaved where llama.cpp does so on this CPU
                rows = fields["gate_up_proj"].weight_shape[0]
                assert fields["gate_up_proj"].packing == (GGML_X8 if interleaves(QT.Q4_K, rows) else GGML)
                assert fields["down_proj"].packing == GGML  # Q6_K: no interleaved form on x86
                # the attention's Q8_0 matrices and the head stay in their blocks; the F32 router not
                assert "model.layers.0.self_attn.q_proj" in kept and "lm_head" in kept
                assert not any(name.endswith("mlp.gate") for name in kept)
                greedy = GenerationConfig(
                    max_new_tokens=8, sampling=SamplingConfig(greedy=True), ignore_eos=True
                )
                assert len(generate_text(model, PROMPT, greedy).token_ids) == 8
            ids = torch.tensor(PROMPT)
            logits[kernels] = model.forward(ids, model.new_kv_cache(), logits_to_keep=0).float()
        finally:
            model.close()
    # A perturbation can flip a near-tie in routing at some position (bfloat16 itself moves one
    # logit row of this tiny model by 1.6 against float32), so the typical row is what is compared.
    exact, fast = logits["exact"], logits["ggml"]
    row_error = (fast - exact).abs().max(dim=-1).values / exact.abs().max()
    assert row_error.median() < 0.05
    assert (fast.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75


@needs_ggml
def test_float32_in_place_experts_go_through_one_ggml_graph_with_the_same_tokens(tiny_q4_k_m):
    """A float32 model's SwiGLU experts, used in place, run gate/up, SwiGLU and down as one ggml
    graph (`routed_swiglu`): the logits of two ggml calls with torch's gate between, to rounding,
    and the same greedy tokens."""
    model = load_model(tiny_q4_k_m, dataclasses.replace(_config("ggml"), dtype="float32"))
    try:
        layers = [m for m in model.hf_model.modules() if isinstance(m, OffloadedExperts)]
        assert model.dtype == torch.float32 and all(m.grouped_in_ggml and m.swiglu_in_ggml for m in layers)
        greedy = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(greedy=True), ignore_eos=True)
        runs = []
        for fused in (True, False):
            for m in layers:
                m.__dict__["swiglu_in_ggml"] = fused
            logits = model.forward(torch.tensor(PROMPT), model.new_kv_cache(), logits_to_keep=0)
            runs.append((logits, list(generate_text(model, PROMPT, greedy).token_ids)))
        (one, tokens_one), (two, tokens_two) = runs
        torch.testing.assert_close(one, two, rtol=1e-4, atol=1e-4 * two.abs().max().item())
        assert tokens_one == tokens_two
    finally:
        model.close()


def test_ggml_kernels_without_llama_cpp_are_refused_by_name(tiny_q4_k_m, monkeypatch):
    monkeypatch.setattr(ggml_library, "library", lambda: (None, "ggml's kernels come with llama-cpp-python"))
    with pytest.raises(
        InvalidConfigError, match="--kernels ggml cannot run: ggml's kernels come with llama-cpp"
    ):
        load_model(tiny_q4_k_m, _config("ggml"))
    with pytest.raises(InvalidRequestError, match="Unknown kernels 'fast'"):
        OffloadConfig(kernels="fast").validate()


@needs_ggml
def test_with_ggml_kernels_speculation_streaming_and_cpu_misses_keep_plain_greedy_tokens(tiny_q4_k_m):
    """ggml's products do not depend on how many tokens a call carries, so self-speculation stays
    lossless; experts copied into cache slots over a simulated link (computed one by one, from the
    file's rows) and misses computed on the CPU give the same tokens as the in-place store (a
    layer's experts together, from rows interleaved as llama.cpp keeps them: the same products up
    to float32 rounding)."""
    greedy = {"max_new_tokens": 16, "sampling": SamplingConfig(greedy=True), "ignore_eos": True}
    spec = SpecConfig(mode="self", top_r=1, draft_len=4)
    tokens = []
    for budget, link in (("all", None), ("4", 50.0)):
        config = dataclasses.replace(
            _config("ggml"), expert_budget=ExpertBudget.parse(budget), sim_link_gbps=link
        )
        model = load_model(tiny_q4_k_m, config)
        try:
            plain = list(generate_text(model, PROMPT, GenerationConfig(**greedy)).token_ids)
            assert (
                list(generate_text(model, PROMPT, GenerationConfig(**greedy, spec=spec)).token_ids) == plain
            )
            misses_on_cpu = GenerationConfig(**greedy, cpu_experts="always")
            assert list(generate_text(model, PROMPT, misses_on_cpu).token_ids) == plain
            # in place a layer's experts go through ggml together; from cache slots one by one: the
            # strategy each layer was given when it was installed
            layers = [m for m in model.hf_model.modules() if isinstance(m, OffloadedExperts)]
            assert [m.grouped_in_ggml for m in layers] == [link is None] * len(layers)
            chosen = [m.execute.__func__ for m in layers]
            wanted = OffloadedExperts._in_place_ggml if link is None else OffloadedExperts._through_cache
            assert chosen == [wanted] * len(layers)
            # rows are interleaved only where ggml reads them in place, never in copies into slots
            gate_up = model.store.layout_of(0).fields[0]
            interleaved = link is None and interleaves(QT.Q4_K, gate_up.weight_shape[0])
            assert gate_up.packing == (GGML_X8 if interleaved else GGML)
        finally:
            model.close()
        tokens.append(plain)
    assert tokens[0] == tokens[1]


@needs_ggml
def test_a_bfloat16_gguf_with_ggml_kernels_keeps_its_rows_and_gives_the_exact_kernels_tokens(tmp_path):
    """BF16 experts and matrices stay in the file's rows and go through ggml's bfloat16 kernel: the
    same sums as torch's bfloat16 matmul up to their order, so the same greedy tokens."""
    path = write_tiny_gguf(tmp_path, expert_type=QT.BF16, down_type=QT.BF16, other_type=QT.BF16)
    greedy = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(greedy=True), ignore_eos=True)
    tokens, logits = {}, {}
    for kernels in ("exact", "ggml"):
        model = load_model(path, _config(kernels))
        try:
            fields = {f.name: f.packing for f in model.store.layout_of(0).fields}
            kept = [name for name, m in model.hf_model.named_modules() if isinstance(m, GgmlLinear)]
            ggml = kernels == "ggml"
            assert fields == {"gate_up_proj": GGML if ggml else None, "down_proj": GGML if ggml else None}
            assert ("model.layers.0.self_attn.o_proj" in kept) == ggml and ("lm_head" in kept) == ggml
            tokens[kernels] = list(generate_text(model, PROMPT, greedy).token_ids)
            logits[kernels] = model.forward(torch.tensor(PROMPT), model.new_kv_cache(), logits_to_keep=0)
        finally:
            model.close()
    assert tokens["ggml"] == tokens["exact"]
    scale = logits["exact"].float().abs().max()
    assert (logits["ggml"].float() - logits["exact"].float()).abs().max() < 0.02 * scale
