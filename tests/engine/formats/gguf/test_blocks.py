"""engine.formats.gguf.blocks against gguf's numpy reference: bit-exact for every type in the table."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from engine.errors import EngineError, UnsupportedQuantizationError
from engine.formats.gguf import blocks as ggml_quants
from engine.formats.gguf.blocks import TYPES, dequantize, linear, row_bytes

ALL_TYPES = sorted(TYPES, key=lambda t: t.name)
SHAPES = [(5, 3), (4, 3, 2)]  # (rows, blocks a row) and (experts, rows, blocks a row)


def _has_quantizer(ggml_type: GGMLQuantizationType) -> bool:
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    try:
        quants.quantize(np.zeros((1, block_size), np.float32), ggml_type)
    except NotImplementedError:
        return False
    return True


QUANTIZABLE = [t for t in ALL_TYPES if _has_quantizer(t)]


def _logical_shape(ggml_type, shape) -> tuple[int, ...]:
    """`shape` with its last dim in blocks -> weights; float types get 96 weights a row."""
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    per_block = block_size if block_size > 1 else 32
    return (*shape[:-1], shape[-1] * per_block)


def _reference(data: np.ndarray, ggml_type) -> torch.Tensor:
    with np.errstate(over="ignore"):  # MXFP4's largest scales overflow to inf, in both
        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, ggml_type)))


def _random_valid_bytes(ggml_type, logical_shape, rng) -> np.ndarray:
    """Random blocks whose float fields (scales, values) are finite: no NaN to compare."""
    traits = TYPES[ggml_type]
    n_bytes = row_bytes(ggml_type, logical_shape[-1])
    data = rng.integers(0, 256, (*logical_shape[:-1], n_bytes), dtype=np.uint8)
    blocks = data.reshape(-1, traits.block_bytes)
    start = 0
    for field in traits.fields:
        count = blocks.shape[0]
        # normal values over a wide range of magnitudes, some of them f16 subnormals
        values = rng.standard_normal((count, 1)) * np.exp2(rng.integers(-22, 6, (count, 1)))
        if field.kind == "f16":
            raw = values.astype(np.float16).view(np.uint8)
        elif field.kind == "f32":
            raw = values.astype(np.float32).view(np.uint8)
        elif field.kind == "bf16":
            raw = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raw = None
        if raw is not None:
            blocks[:, start : start + field.nbytes] = raw
        start += field.nbytes
    return data


@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "3d"])
@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_quantized_floats(ggml_type, shape):
    logical = _logical_shape(ggml_type, shape)
    weights = np.random.default_rng(int(ggml_type)).standard_normal(logical).astype(np.float32)
    data = np.ascontiguousarray(quants.quantize(weights, ggml_type)).view(np.uint8)
    got = dequantize(torch.from_numpy(data), ggml_type, logical, torch.float32)
    assert torch.equal(got, _reference(data, ggml_type).reshape(logical))


@pytest.mark.parametrize("shape", SHAPES, ids=["2d", "3d"])
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_random_valid_blocks(ggml_type, shape):
    logical = _logical_shape(ggml_type, shape)
    data = _random_valid_bytes(ggml_type, logical, np.random.default_rng(100 + int(ggml_type)))
    got = dequantize(torch.from_numpy(data), ggml_type, logical, torch.float32)
    reference = _reference(data, ggml_type)
    assert not reference.isnan().any()
    assert got.shape == logical
    assert torch.equal(got, reference.reshape(logical))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0])
def test_other_dtypes_are_the_float32_result_cast_once(ggml_type, dtype):
    logical = _logical_shape(ggml_type, (3, 2))
    data = _random_valid_bytes(ggml_type, logical, np.random.default_rng(7))
    got = dequantize(torch.from_numpy(data), ggml_type, logical, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, _reference(data, ggml_type).to(dtype))


def test_every_layout_fills_its_block_and_sizes_come_from_gguf():
    for ggml_type, traits in TYPES.items():
        assert (traits.block_size, traits.block_bytes) == GGML_QUANT_SIZES[ggml_type]
        assert sum(field.nbytes for field in traits.fields) == traits.block_bytes
        assert traits.name == ggml_type.name


@pytest.mark.parametrize(
    ("ggml_type", "n_weights", "expected"),
    [
        (GGMLQuantizationType.F32, 768, 3072),
        (GGMLQuantizationType.BF16, 768, 1536),
        (GGMLQuantizationType.Q8_0, 2048, 2048 // 32 * 34),
        (GGMLQuantizationType.Q4_K, 2048, 8 * 144),
        (GGMLQuantizationType.Q6_K, 768, 3 * 210),
        (GGMLQuantizationType.MXFP4, 2880, 90 * 17),
    ],
)
def test_row_bytes(ggml_type, n_weights, expected):
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    assert row_bytes(ggml_type, n_weights) == expected == n_weights // block_size * block_bytes


def test_a_row_that_does_not_fill_whole_blocks_is_a_value_error():
    with pytest.raises(ValueError, match=r"Q4_K.*\b300\b"):
        row_bytes(GGMLQuantizationType.Q4_K, 300)
    with pytest.raises(ValueError, match="Q4_0"):
        dequantize(torch.zeros(18, dtype=torch.uint8), GGMLQuantizationType.Q4_0, (1, 16), torch.float32)


def test_bytes_that_do_not_match_the_shape_are_a_value_error():
    data = torch.zeros(2, 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Q4_0.*\(3, 32\)"):
        dequantize(data, GGMLQuantizationType.Q4_0, (3, 32), torch.float32)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(data.view(torch.int8), GGMLQuantizationType.Q4_0, (2, 32), torch.float32)


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.Q8_1, 9999])
def test_an_unsupported_type_says_which_and_lists_the_supported(ggml_type):
    with pytest.raises(UnsupportedQuantizationError) as caught:
        row_bytes(ggml_type, 256)
    message = str(caught.value)
    assert getattr(ggml_type, "name", "9999") in message
    assert all(t.name in message for t in ALL_TYPES)
    assert isinstance(caught.value, EngineError)
    assert caught.value.kind == "unsupported_quantization"
    with pytest.raises(UnsupportedQuantizationError):
        dequantize(torch.zeros(1, 66, dtype=torch.uint8), ggml_type, (1, 256), torch.float32)


@pytest.mark.parametrize(
    "ggml_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4]
)
def test_linear_is_f_linear_on_the_reference_weight(ggml_type):
    rng = np.random.default_rng(3)
    out_features, in_features = 48, _logical_shape(ggml_type, (1, 2))[-1]
    data = _random_valid_bytes(ggml_type, (out_features, in_features), rng)
    if ggml_type == GGMLQuantizationType.MXFP4:  # realistic scales: 2^-8 .. 2^0
        data.reshape(-1, 17)[:, 0] = rng.integers(119, 128, data.size // 17)
    x = torch.from_numpy(rng.standard_normal((5, in_features)).astype(np.float32))
    weight = _reference(data, ggml_type).reshape(out_features, in_features)
    got = linear(x, torch.from_numpy(data), ggml_type, out_features, in_features)
    assert got.shape == (5, out_features)
    torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_0])
def test_one_expert_dequantizes_from_its_own_byte_range(ggml_type):
    n_experts, rows = 4, 6
    logical = _logical_shape(ggml_type, (n_experts, rows, 2))
    data = _random_valid_bytes(ggml_type, logical, np.random.default_rng(11))
    reference = _reference(data, ggml_type).reshape(logical)
    stacked = torch.from_numpy(data)  # [E, rows, row_bytes]
    for expert in range(n_experts):
        own_bytes = stacked[expert].clone()  # as if copied alone to the device cache
        got = dequantize(own_bytes, ggml_type, logical[1:], torch.float32)
        assert torch.equal(got, reference[expert])


def test_unpack_bits_gives_low_bits_first_within_each_group():
    packed = torch.tensor([[0x21, 0x43]], dtype=torch.uint8)
    assert ggml_quants.unpack_bits(packed, 4, 2).tolist() == [[1, 3, 2, 4]]
    assert ggml_quants.unpack_bits(packed, 4, 1).tolist() == [[1, 2, 3, 4]]
    assert ggml_quants.unpack_bits(torch.tensor([[0b10]], dtype=torch.uint8), 1, 1).tolist() == [
        [0, 1, 0, 0, 0, 0, 0, 0]
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_gives_the_cpu_result(ggml_type):
    logical = _logical_shape(ggml_type, (3, 2))
    data = torch.from_numpy(_random_valid_bytes(ggml_type, logical, np.random.default_rng(5)))
    on_cpu = dequantize(data, ggml_type, logical, torch.float32)
    on_cuda = dequantize(data.cuda(), ggml_type, logical, torch.float32)
    assert on_cuda.device.type == "cuda"
    assert torch.equal(on_cuda.cpu(), on_cpu)


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K])
def test_k_quant_linear_is_f_linear_on_dequantize_bit_for_bit_whatever_came_before(ggml_type):
    """The Q4_K/Q6_K matmul builds the weight in a reused buffer: a larger, then a smaller, then the
    first weight again must each give exactly `F.linear(x, dequantize(...))`."""
    rng = np.random.default_rng(5)
    cases = []
    for rows, blocks in ((40, 3), (7, 1), (40, 3)):
        in_features = _logical_shape(ggml_type, (1, blocks))[-1]
        data = torch.from_numpy(_random_valid_bytes(ggml_type, (rows, in_features), rng))
        cases.append((data, rows, in_features))
    cases[2] = cases[0]
    for step, (data, rows, in_features) in enumerate(cases):
        mode = torch.inference_mode(step == 0)  # the engine's mode first: the buffer serves both
        x = torch.from_numpy(rng.standard_normal((3, in_features)).astype(np.float32))
        weight = dequantize(data, ggml_type, (rows, in_features), torch.float32)
        with mode:
            got, got_one = (linear(v, data, ggml_type, rows, in_features) for v in (x, x[0]))
        assert torch.equal(got, F.linear(x, weight))
        assert torch.equal(got_one, F.linear(x[0], weight))


@pytest.mark.parametrize("ggml_type", [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K])
def test_k_quant_linear_in_row_parts_is_the_whole_matmul(ggml_type, monkeypatch):
    """`linear` builds the weight a few rows at a time (`CHUNK_BYTES`): uneven parts, in order."""
    from engine.tiny.kquant_encode import quantize

    rows, in_features = 37, 512
    weight = np.random.default_rng(8).standard_normal((rows, in_features)).astype(np.float32) * 0.02
    data = torch.from_numpy(quantize(weight, ggml_type)).view(torch.uint8).reshape(rows, -1)
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((4, in_features)).astype(np.float32))
    expected = F.linear(x, dequantize(data, ggml_type, (rows, in_features), torch.float32))
    monkeypatch.setattr(ggml_quants, "CHUNK_BYTES", 10 * 4 * in_features)  # parts of 10, 10, 10, 7 rows
    torch.testing.assert_close(linear(x, data, ggml_type, rows, in_features), expected, atol=1e-6, rtol=1e-6)
