"""Decode-step attention on the CPU as two matmuls over folded query heads: the values of
transformers' sdpa attention, and the model's logits unchanged with it."""

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

import engine.model.cpu_attention as cpu_attention
from engine.model.cpu_attention import ATTENTION, cpu_attention_forward, folded_attention, use_cpu_attention
from engine.model.hf_calls import with_cache
from engine.model.kv_cache import new_kv_cache
from engine.model.tiny import build_tiny_model

BATCH, HEADS, KV_HEADS, LENGTH, DIM = 2, 8, 2, 37, 16


def _reference(query, key, value, mask, scale):
    """Attention as transformers' eager path computes it: key heads repeated, then softmax."""
    key, value = repeat_kv(key, HEADS // KV_HEADS), repeat_kv(value, HEADS // KV_HEADS)
    scores = query @ key.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(-1) @ value


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_folded_attention_is_attention_with_each_key_head_shared_by_its_query_heads(queries, mask_kind):
    if mask_kind == "none" and queries > 1:
        pytest.skip("several queries always come with a mask (causal)")
    generator = torch.Generator().manual_seed(queries)
    query = torch.randn(BATCH, HEADS, queries, DIM, generator=generator)
    key, value = (torch.randn(BATCH, KV_HEADS, LENGTH, DIM, generator=generator) for _ in range(2))
    causal = torch.ones(queries, LENGTH, dtype=torch.bool).tril(LENGTH - queries)  # a step after a past
    causal = causal.expand(BATCH, 1, queries, LENGTH).clone()
    causal[1, :, :, :3] = False  # the second row's padding
    mask = {"none": None, "bool": causal, "float": torch.zeros(causal.shape).masked_fill(~causal, -1e9)}
    got = folded_attention(query, key, value, mask[mask_kind], 0.25)
    expected = _reference(query, key, value, mask[mask_kind], 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


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
    cpu_attention_forward(module, one.bfloat16(), key.bfloat16(), key.bfloat16(), None)  # not float32
    cpu_attention_forward(module, torch.randn(1, HEADS, 40, DIM), key, key, None)  # a prefill chunk
    cpu_attention_forward(module, one, key, key, None, position_bias=torch.zeros(1))
    cpu_attention_forward(module, one, key, key, None, s_aux=torch.zeros(HEADS))  # attention sinks
    assert calls == ["folded"] + ["sdpa"] * 4


def test_a_model_on_cpu_attention_gives_sdpa_logits_through_prefill_and_decode_steps(monkeypatch):
    model = build_tiny_model("qwen3_moe")
    model.set_attn_implementation("sdpa")
    prompt, steps = [5, 17, 99, 3, 42, 7, 11], [[64], [12], [13, 14, 15]]  # decode steps, a verify step
    expected = _logits(model, prompt, steps)
    folded = []
    original = cpu_attention.folded_attention
    monkeypatch.setattr(cpu_attention, "folded_attention", lambda *a: folded.append(1) or original(*a))
    assert use_cpu_attention(model) and model.config._attn_implementation == ATTENTION
    got = _logits(model, prompt, steps)
    assert folded  # the decode steps went through it
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    eager = build_tiny_model("qwen3_moe")  # eager (the tiny models' default) is left alone
    assert not use_cpu_attention(eager) and eager.config._attn_implementation == "eager"


def _logits(model, prompt, steps):
    kv_cache = new_kv_cache(model.config)
    out = []
    with torch.inference_mode():
        for ids in [prompt, *steps]:
            kwargs = with_cache(model, kv_cache, use_cache=True)
            out.append(model(input_ids=torch.tensor([ids]), **kwargs).logits[0].float())
    return out
