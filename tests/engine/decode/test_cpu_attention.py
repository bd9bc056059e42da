"""Decode-step attention on the CPU as two matmuls over folded query heads: the values of
transformers' sdpa attention, and the model's logits unchanged with it."""

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

import engine.decode.cpu_attention as cpu_attention
from engine.decode.cpu_attention import ATTENTION, cpu_attention_forward, folded_attention, use_cpu_attention
from engine.model.hf_calls import with_cache
from engine.model.kv_cache import new_kv_cache
from engine.tiny.models import build_tiny_model

BATCH, HEADS, KV_HEADS, LENGTH, DIM = 2, 8, 2, 37, 16


def _reference(query, key, value, mask, scale):
    """Attention as transformers' eager path computes it: key heads repeated, products in the
    inputs' dtype, the softmax in float32."""
    key, value = repeat_kv(key, HEADS // KV_HEADS), repeat_kv(value, HEADS // KV_HEADS)
    scores = query @ key.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(-1, dtype=torch.float32).to(query.dtype) @ value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_folded_attention_is_attention_with_each_key_head_shared_by_its_query_heads(
    queries, mask_kind, dtype
):
    if mask_kind == "none" and queries > 1:
        pytest.skip("several queries always come with a mask (causal)")
    generator = torch.Generator().manual_seed(queries)
    query = torch.randn(BATCH, HEADS, queries, DIM, generator=generator).to(dtype)
    key, value = (torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=generator).to(dtype) for _ in range(2))
    causal = torch.ones(queries, LENGTH, dtype=torch.bool).tril(LENGTH - queries)  # a step after a past
    causal = causal.expand(BATCH, 1, queries, LENGTH).clone()
    causal[1, :, :, :3] = False  # the second row's padding
    additive = torch.zeros(causal.shape, dtype=dtype).masked_fill(~causal, -1e9)
    mask = {"none": None, "bool": causal, "float": additive}
    got = folded_attention(query, key, value, mask[mask_kind], 0.25)
    expected = _reference(query, key, value, mask[mask_kind], 0.25)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    else:  # the same bfloat16 products, summed in the kernel's own order
        torch.testing.assert_close(got, expected)


def test_what_it_does_not_fold_goes_to_transformers_sdpa(monkeypatch):
    calls = []

    def sdpa(module, query, *args, **kwargs):
        calls.append("sdpa")
        return query, None

    monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", sdpa)
    monkeypatch.setattr(cpu_attention, "folded_attention", lambda q, *a: calls.append("folded") or q)
    module = torch.nn.Module().eval()
    key = torch.randn(1, KV_HEADS, LENGTH, DIM)
    one = torch.randn(1, HEADS, 1, DIM)
    cpu_attention_forward(module, one, key, key, None)  # a decode step: folded
    cpu_attention_forward(module, one.double(), key.double(), key.double(), None)  # not a model dtype
    cpu_attention_forward(module, torch.randn(1, HEADS, 40, DIM), key, key, None)  # a prefill chunk
    cpu_attention_forward(module, one, key, key, None, position_bias=torch.zeros(1))
    cpu_attention_forward(module, one, key, key, None, s_aux=torch.zeros(HEADS))  # attention sinks
    assert calls == ["folded"] + ["sdpa"] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_on_cpu_attention_gives_its_logits_through_prefill_and_decode_steps(monkeypatch, dtype):
    """float32: sdpa's logits; bfloat16: eager attention's, whose numerics the folded steps share
    (prefill still goes to sdpa, so the reference is sdpa for prefill and eager for the steps)."""
    model = build_tiny_model("qwen3_moe").to(dtype)
    prompt, steps = [5, 17, 99, 3, 42, 7, 11], [[64], [12], [13, 14, 15]]  # decode steps, a verify step
    model.set_attn_implementation("sdpa")
    expected = _logits(model, prompt, steps, steps_with="eager" if dtype == torch.bfloat16 else None)
    folded = []
    original = cpu_attention.folded_attention
    monkeypatch.setattr(cpu_attention, "folded_attention", lambda *a: folded.append(1) or original(*a))
    assert use_cpu_attention(model) and model.config._attn_implementation == ATTENTION
    got = _logits(model, prompt, steps)
    assert folded  # the decode steps went through it
    for a, b in zip(got, expected, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(a, b, rtol=0.02, atol=0.02 * b.abs().max().item())
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    eager = build_tiny_model("qwen3_moe")  # eager (the tiny models' default) is left alone
    assert not use_cpu_attention(eager) and eager.config._attn_implementation == "eager"


def _logits(model, prompt, steps, steps_with=None):
    """Logits of the prompt, then of each step on the same cache; `steps_with`: the attention
    implementation the steps run on (the prompt keeps the model's)."""
    kv_cache = new_kv_cache(model.config)
    prefill_with = model.config._attn_implementation
    out = []
    with torch.inference_mode():
        for ids in [prompt, *steps]:
            kwargs = with_cache(model, kv_cache, use_cache=True)
            out.append(model(input_ids=torch.tensor([ids]), **kwargs).logits[0].float())
            if steps_with is not None:
                model.set_attn_implementation(steps_with)
    model.set_attn_implementation(prefill_with)
    return out
