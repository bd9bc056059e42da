"""Q4_K repacked for torch's CPU int4 kernel: the bfloat16 path of a GGUF model on the CPU.

The repacked weight is the Q4_K weight up to bfloat16 rounding of each sub-block's scale and
zero; a tiny Q4_K/Q6_K GGUF loaded in bfloat16 on the CPU uses it for every Q4_K expert, keeps
float32 runs on the exact path, and gives transformers' bfloat16 greedy tokens."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from transformers import AutoModelForCausalLM

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.loader import load_model
from engine.model.ggml_encode import quantize
from engine.model.tiny_gguf import gguf_config, write_tiny_gguf
from engine.offload.ggml_int4pack import INT4PACK, int4pack_linear, packed_nbytes, repack_q4_k
from engine.offload.ggml_quants import dequantize

OUT, IN = 64, 512
PROMPT = [3, 17, 42, 99, 7, 250, 11, 64]


@pytest.fixture(scope="module")
def q4_k_weight() -> tuple[torch.Tensor, torch.Tensor]:
    """(Q4_K bytes [OUT, row bytes], the float32 weight they hold), rows of different ranges."""
    rng = np.random.default_rng(5)
    dense = rng.standard_normal((OUT, IN)).astype(np.float32) * rng.uniform(0.01, 3.0, (OUT, 1))
    data = torch.from_numpy(quantize(dense.astype(np.float32), QT.Q4_K)).view(torch.uint8).reshape(OUT, -1)
    return data, dequantize(data, QT.Q4_K, (OUT, IN), torch.float32)


def test_the_repacked_weight_is_the_q4_k_weight_to_bfloat16_rounding(q4_k_weight):
    data, weight = q4_k_weight
    packed = repack_q4_k(data, OUT, IN)
    assert packed.numel() == packed_nbytes(OUT, IN) == OUT * IN // 256 * 160
    rebuilt = int4pack_linear(torch.eye(IN, dtype=torch.bfloat16), packed, OUT, IN).float().T  # [OUT, IN]
    error = (rebuilt - weight).abs()
    bf16_error = (weight.bfloat16().float() - weight).abs()
    # scale and zero rounded to bfloat16, then the output: a few bfloat16 roundings of the weight
    assert error.max() <= 4 * bf16_error.max()
    assert error.mean() <= 4 * bf16_error.mean()


@pytest.mark.parametrize("rows", [1, 5])
def test_int4pack_linear_is_the_float32_product_to_bfloat16_precision(q4_k_weight, rows):
    data, weight = q4_k_weight
    packed = repack_q4_k(data, OUT, IN)
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows))
    expected = F.linear(x.bfloat16().float(), weight)
    got = int4pack_linear(x.bfloat16(), packed, OUT, IN)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, OUT)
    assert (got.float() - expected).abs().max() <= 1e-2 * expected.abs().max()
    as_float = int4pack_linear(x, packed, OUT, IN)  # other dtypes are cast in and out
    assert as_float.dtype == torch.float32 and torch.equal(as_float, got.float())


def test_weights_without_an_int4pack_form_and_wrong_bytes_are_value_errors(q4_k_weight):
    data, _ = q4_k_weight
    with pytest.raises(ValueError, match="no int4pack form"):
        repack_q4_k(data[:8], 8, IN)  # 8 output rows: the kernel takes blocks of 16
    with pytest.raises(ValueError, match="Q4_K 64×512 takes"):
        repack_q4_k(data[:, :100], OUT, IN)
    with pytest.raises(ValueError, match="do not hold a 64×256 weight"):
        int4pack_linear(torch.zeros(1, 256), repack_q4_k(data, OUT, IN), OUT, 256)


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
        assert fields["down_proj"].packing is None  # Q6_K stays in its blocks
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


def test_float32_runs_keep_the_files_blocks(tiny_q4_k_m):
    model = load_model(tiny_q4_k_m, _config("float32"))
    try:
        assert all(f.packing is None for f in model.store.layout_of(0).fields)
    finally:
        model.close()
