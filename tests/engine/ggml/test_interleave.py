"""llama.cpp's interleaved rows (`engine.ggml.interleave`): a layer's experts kept in
ggml's own interleaving buffer give the products of the file's rows to float32 rounding, a token's
products do not depend on the batch it comes in, the memory goes back to ggml with the last tensor
over it, and what ggml would abort on is a ValueError here; a model's resident matrices of such a
type are interleaved too."""

import gc

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.ggml import interleave as ggml_interleave
from engine.ggml import kernels as ggml_kernels
from engine.ggml import library as ggml_library
from engine.ggml import memory as ggml_memory
from engine.loader import load_model
from engine.resident.ggml_linear import GgmlLinear
from engine.tiny.gguf_writer import write_tiny_gguf
from engine.tiny.kquant_encode import quantize

needs_interleaving = pytest.mark.skipif(
    not ggml_library.available()[0] or not ggml_interleave.interleaves(int(QT.Q4_K), 64),
    reason="llama-cpp-python is not installed or its ggml interleaves no Q4_K rows on this CPU",
)
EXPERTS, OUT, IN = 6, 64, 512


def _plain_layer(offset: int) -> tuple[torch.Tensor, int]:
    """`EXPERTS` random Q4_K `[OUT, IN]` weights, each at `offset` in its expert's bytes."""
    rng = np.random.default_rng(1)
    weights = [quantize(rng.standard_normal((OUT, IN)).astype(np.float32), QT.Q4_K) for _ in range(EXPERTS)]
    nbytes = weights[0].nbytes
    layer = torch.zeros(EXPERTS, offset + nbytes + 64, dtype=torch.uint8)
    for e, weight in enumerate(weights):
        layer[e, offset : offset + nbytes] = torch.from_numpy(weight.view(np.uint8).reshape(-1))
    return layer, nbytes


def _interleaved(plain: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    layer = ggml_interleave.allocate(plain.numel(), "a test layer").view(plain.shape)
    layer.copy_(plain)
    for e in range(EXPERTS):
        field = plain[e, offset : offset + nbytes].contiguous()
        ggml_interleave.interleave_into(layer[e, offset : offset + nbytes], field, int(QT.Q4_K), OUT, IN)
    return layer


def test_only_weights_of_eight_row_groups_in_an_interleaved_type_interleave():
    assert not ggml_interleave.interleaves(int(QT.Q4_K), 12)  # ggml's groups are 8 rows
    assert not ggml_interleave.interleaves(int(QT.BF16), 64)
    assert not ggml_interleave.interleaves(int(QT.Q4_K), 0)


@needs_interleaving
def test_interleaved_experts_give_the_files_products_to_rounding_and_one_tokens_products_in_a_batch():
    offset = 64  # a field after another inside each expert, as gate/up and down lie
    plain, nbytes = _plain_layer(offset)
    layer = _interleaved(plain, offset, nbytes)
    assert not torch.equal(layer, plain)  # the rows really were reordered
    field, ids = (offset, int(QT.Q4_K), OUT, IN), [[1, 4], [0, 5], [4, 1], [2, 3]]
    x = torch.randn(4, IN)
    got, want = (ggml_kernels.linear_routed(x, mem, field, ids) for mem in (layer, plain))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for t in range(4):  # mul_mat_id runs each route on its own row: no 4-row kernel for a batch
        alone = ggml_kernels.linear_routed(x[t : t + 1], layer, field, ids[t : t + 1])
        assert torch.equal(alone[0], got[t])
    one = ggml_kernels.linear(x[:1], layer[1, offset : offset + nbytes].view(OUT, -1), QT.Q4_K, OUT, IN)
    torch.testing.assert_close(one[0], got[0, 0], rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_interleaving
def test_interleaving_memory_goes_back_to_ggml_with_its_last_tensor():
    layer, other = ggml_interleave.allocate(4096, "a test layer"), ggml_interleave.allocate(8192, "another")
    start = layer.data_ptr()
    assert ggml_memory.owned_buffer(start + 4095)[0] == start + 4096  # each region found as its own
    assert ggml_memory.owned_buffer(other.data_ptr() + 8191)[0] == other.data_ptr() + 8192
    assert ggml_memory.owned_buffer(start + 4096) in (None, ggml_memory.owned_buffer(other.data_ptr()))
    view = layer[128:]
    del layer
    gc.collect()
    assert ggml_memory.owned_buffer(start) is not None  # a view still holds it
    del view
    gc.collect()
    assert ggml_memory.owned_buffer(start) is None


@needs_interleaving
def test_what_ggml_would_abort_on_is_a_value_error():
    plain, nbytes = _plain_layer(0)
    layer = ggml_interleave.allocate(plain.numel(), "a test layer").view(plain.shape)
    blocks = plain[0, :nbytes].contiguous()
    with pytest.raises(ValueError, match="does not lie inside"):
        ggml_interleave.interleave_into(plain[0, :nbytes], blocks, int(QT.Q4_K), OUT, IN)
    with pytest.raises(ValueError, match="does not lie inside"):  # would run past the buffer's end
        ggml_interleave.interleave_into(layer[-1, -64:], blocks, int(QT.Q4_K), OUT, IN)
    with pytest.raises(ValueError, match="contiguous bytes"):
        ggml_interleave.interleave_into(layer[0, :nbytes], blocks[:-1], int(QT.Q4_K), OUT, IN)
    half = nbytes // 2
    with pytest.raises(ValueError, match="does not interleave"):  # 60 rows: not in groups of 8
        ggml_interleave.interleave_into(layer[0, :half], blocks[:half], int(QT.Q4_K), OUT - 4, IN)


@needs_interleaving
def test_a_models_resident_q4_k_matrices_are_interleaved_and_give_the_files_products(tmp_path, monkeypatch):
    """The attention's Q4_K matrices of a `--kernels ggml` model lie in interleaving memory, as
    llama.cpp's CPU_REPACK buffers hold them: their products equal the file's rows' to float32
    rounding for one token and a batch, and greedy decoding (plain and self-speculative) gives the
    tokens of a model that keeps the file's rows."""
    path = write_tiny_gguf(tmp_path, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q4_K)
    config = OffloadConfig(
        device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"), kernels="ggml"
    )
    prompt = [3, 17, 42, 99, 7, 25, 11, 64] * 3
    greedy = {"max_new_tokens": 16, "sampling": SamplingConfig(greedy=True), "ignore_eos": True}
    runs = []
    for interleaving in (True, False):
        if not interleaving:
            monkeypatch.setattr(ggml_interleave, "interleaves", lambda ggml_type, rows: False)
        model = load_model(path, config)
        try:
            q_proj = model.hf_model.model.layers[0].self_attn.q_proj
            assert isinstance(q_proj, GgmlLinear)
            owned = ggml_memory.owned_buffer(q_proj.blocks.data_ptr()) is not None
            assert owned == interleaving
            x = torch.randn(5, q_proj.in_features, generator=torch.Generator().manual_seed(0))
            products = (q_proj(x), q_proj(x[:1]))
            plain = list(generate_text(model, prompt, GenerationConfig(**greedy)).token_ids)
            spec = GenerationConfig(**greedy, spec=SpecConfig(mode="self", top_r=1, draft_len=4))
            assert list(generate_text(model, prompt, spec).token_ids) == plain
            runs.append((products, plain))
        finally:
            model.close()
    (interleaved, tokens), (files, file_tokens) = runs
    for a, b in zip(interleaved, files, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
    assert tokens == file_tokens
