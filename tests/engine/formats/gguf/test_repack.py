"""GGUF experts repacked at load for the CPU: Q4_K for torch's int4 kernel (bfloat16 runs), Q6_K
as int8 codes (any dtype).

The int4pack weight is the Q4_K weight up to bfloat16 rounding of each sub-block's scale and
zero; the Q6_K int8 product is the file's float32 product bit for bit. A tiny Q4_K/Q6_K GGUF
loaded in bfloat16 on the CPU uses both and gives transformers' bfloat16 greedy tokens; float32
runs keep Q4_K in its blocks (the float32 exactness suite, test_gguf_loading, covers them)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from transformers import AutoModelForCausalLM

from engine.config import ExpertBudget, OffloadConfig
from engine.formats.gguf.blocks import dequantize, linear
from engine.formats.gguf.repack import (
    INT4PACK,
    Q6_K_INT8,
    _pack_q4_k_nibbles,
    _q4_k_codes,
    _row_block,
    packed_nbytes,
    repack,
    repacked_linear,
)
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.loader import load_model
from engine.tiny.gguf_writer import gguf_config, write_tiny_gguf
from engine.tiny.kquant_encode import quantize

OUT, IN = 64, 512
PROMPT = [3, 17, 42, 99, 7, 250, 11, 64]


def _weight(ggml_type: QT) -> tuple[torch.Tensor, torch.Tensor]:
    """(`ggml_type` bytes [OUT, row bytes], the float32 weight they hold), rows of different ranges."""
    rng = np.random.default_rng(5)
    dense = rng.standard_normal((OUT, IN)).astype(np.float32) * rng.uniform(0.01, 3.0, (OUT, 1))
    data = torch.from_numpy(quantize(dense.astype(np.float32), ggml_type)).view(torch.uint8).reshape(OUT, -1)
    return data, dequantize(data, ggml_type, (OUT, IN), torch.float32)


@pytest.fixture(scope="module")
def q4_k_weight() -> tuple[torch.Tensor, torch.Tensor]:
    return _weight(QT.Q4_K)


@pytest.mark.parametrize("rows", [1, 5])
def test_the_q6_k_int8_product_is_the_files_float32_product_bit_for_bit(rows):
    data, _ = _weight(QT.Q6_K)
    packed = repack(Q6_K_INT8, data, OUT, IN)
    assert packed.numel() == packed_nbytes(Q6_K_INT8, OUT, IN) == OUT * IN // 256 * 274
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(repacked_linear(Q6_K_INT8, x, packed, OUT, IN), linear(x, data, QT.Q6_K, OUT, IN))
    in_bf16 = repacked_linear(Q6_K_INT8, x.bfloat16(), packed, OUT, IN)
    assert torch.equal(in_bf16, linear(x.bfloat16().float(), data, QT.Q6_K, OUT, IN).bfloat16())


def test_the_repacked_weight_is_the_q4_k_weight_to_bfloat16_rounding(q4_k_weight):
    data, weight = q4_k_weight
    packed = repack(INT4PACK, data, OUT, IN)
    assert packed.numel() == packed_nbytes(INT4PACK, OUT, IN) == OUT * IN // 256 * 160
    identity = torch.eye(IN, dtype=torch.bfloat16)
    rebuilt = repacked_linear(INT4PACK, identity, packed, OUT, IN).float().T  # [OUT, IN]
    error = (rebuilt - weight).abs()
    bf16_error = (weight.bfloat16().float() - weight).abs()
    # scale and zero rounded to bfloat16, then the output: a few bfloat16 roundings of the weight
    assert error.max() <= 4 * bf16_error.max()
    assert error.mean() <= 4 * bf16_error.mean()


@pytest.mark.parametrize("rows", [1, 5])
def test_int4pack_linear_is_the_float32_product_to_bfloat16_precision(q4_k_weight, rows):
    data, weight = q4_k_weight
    packed = repack(INT4PACK, data, OUT, IN)
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    expected = F.linear(x.bfloat16().float(), weight)
    got = repacked_linear(INT4PACK, x.bfloat16(), packed, OUT, IN)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, OUT)
    assert (got.float() - expected).abs().max() <= 1e-2 * expected.abs().max()
    as_float = repacked_linear(INT4PACK, x, packed, OUT, IN)  # other dtypes are cast in and out
    assert as_float.dtype == torch.float32 and torch.equal(as_float, got.float())


def test_weights_without_an_int4pack_form_and_wrong_bytes_are_value_errors(q4_k_weight):
    data, _ = q4_k_weight
    with pytest.raises(ValueError, match="no int4pack form"):
        repack(INT4PACK, data[:8], 8, IN)  # 8 output rows: the kernel takes blocks of 16
    with pytest.raises(ValueError, match="whole blocks of 256"):
        repack(Q6_K_INT8, data, OUT, 500)
    with pytest.raises(ValueError, match="Q4_K 64×512 takes"):
        repack(INT4PACK, data[:, :100], OUT, IN)
    with pytest.raises(ValueError, match="int4pack bytes do not hold a 64×256 weight"):
        repacked_linear(INT4PACK, torch.zeros(1, 256), repack(INT4PACK, data, OUT, IN), OUT, 256)
    with pytest.raises(ValueError, match="Unknown packing"):
        packed_nbytes("int3", OUT, IN)


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-int4pack")
    return write_tiny_gguf(folder, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q8_0)


def _config(dtype: str) -> OffloadConfig:
    return OffloadConfig(device="cpu", dtype=dtype, expert_budget=ExpertBudget.parse("all"))


def test_a_gguf_in_bfloat16_on_the_cpu_repacks_q4_k_and_gives_transformers_greedy_tokens(tiny_q4_k_m):
    model = load_model(tiny_q4_k_m, _config("bfloat16"))
    try:
        fields = {f.name: f for f in model.store.layout_of(0).fields}
        assert fields["gate_up_proj"].packing == INT4PACK  # Q4_K
        assert fields["down_proj"].packing == Q6_K_INT8
        greedy = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(greedy=True), ignore_eos=True)
        tokens = generate_text(model, PROMPT, greedy).token_ids
    finally:
        model.close()
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_q4_k_m.parent, gguf_file=tiny_q4_k_m.name, config=gguf_config(tiny_q4_k_m), dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None
        )[0, len(PROMPT) :]
    assert list(tokens) == expected.tolist()


def test_float32_runs_keep_q4_k_in_its_blocks(tiny_q4_k_m):
    model = load_model(tiny_q4_k_m, _config("float32"))
    try:
        fields = {f.name: f for f in model.store.layout_of(0).fields}
        assert fields["gate_up_proj"].packing is None and fields["down_proj"].packing == Q6_K_INT8
    finally:
        model.close()


def test_the_nibble_packer_lays_codes_out_as_torchs_op_does():
    row_block = _row_block()  # checked once on a 128-row probe; here a taller, wider matrix
    if row_block is None:
        pytest.skip("this CPU's int4pack layout is not one the packer knows: the op is used")
    generator = torch.Generator().manual_seed(3)
    nibbles = torch.randint(0, 256, (3 * row_block, 384), dtype=torch.uint8, generator=generator)
    expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(_q4_k_codes(nibbles).int(), 1)
    packed = torch.empty(nibbles.numel(), dtype=torch.uint8)
    _pack_q4_k_nibbles(nibbles, row_block, packed)
    assert torch.equal(packed, expected.reshape(-1))
