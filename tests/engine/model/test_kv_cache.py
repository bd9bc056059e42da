"""The engine's KV cache is the model's own, and goes back to a prefix, recurrent state included."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from engine.model.hf_calls import with_cache
from engine.model.kv_cache import RecurrentState, is_croppable, new_kv_cache, rewind_cache
from engine.model.prefix_cache import PrefixCache
from engine.model.tiny import build_tiny_model


@pytest.fixture(scope="module")
def qwen3_next():
    return build_tiny_model("qwen3_next")


def _next_logits(model, kv_cache, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        inputs = torch.tensor([ids])
        return model(input_ids=inputs, **with_cache(model, kv_cache, use_cache=True)).logits[0, -1]


def test_linear_attention_layers_get_their_recurrent_cache(qwen3_next):
    kv_cache = new_kv_cache(qwen3_next.config, rewindable=True)
    linear = [isinstance(layer, LinearAttentionCacheLayerMixin) for layer in kv_cache.layers]
    assert linear == [kind == "linear_attention" for kind in qwen3_next.config.layer_types]
    assert any(linear) and not all(linear)


def test_a_rewound_recurrent_state_continues_as_if_never_advanced(qwen3_next):
    prompt, drafted, token = [5, 17, 99, 3, 42, 7], [11, 12, 13], [64]
    fresh = new_kv_cache(qwen3_next.config, rewindable=True)
    _next_logits(qwen3_next, fresh, prompt)
    expected = _next_logits(qwen3_next, fresh, token)

    kv_cache = new_kv_cache(qwen3_next.config, rewindable=True)
    _next_logits(qwen3_next, kv_cache, prompt)
    saved = RecurrentState.save(kv_cache)
    _next_logits(qwen3_next, kv_cache, drafted)
    for _ in range(2):  # a saved state can be gone back to more than once
        rewind_cache(kv_cache, len(prompt), saved)
        assert kv_cache.get_seq_length() == len(prompt)
        torch.testing.assert_close(_next_logits(qwen3_next, kv_cache, token), expected, rtol=0, atol=1e-5)


def test_a_recurrent_state_is_never_cropped_silently(qwen3_next):
    kv_cache = new_kv_cache(qwen3_next.config, rewindable=True)
    _next_logits(qwen3_next, kv_cache, [1, 2, 3])
    saved = RecurrentState.save(kv_cache)
    _next_logits(qwen3_next, kv_cache, [4, 5])
    with pytest.raises(RuntimeError, match="needs a state saved there"):
        rewind_cache(kv_cache, 4, saved)  # saved at 3 positions, not 4
    with pytest.raises(RuntimeError, match="needs a state saved there"):
        rewind_cache(kv_cache, 3)


def test_a_rewindable_cache_keeps_every_position_of_sliding_layers():
    config = build_tiny_model("gpt_oss").config
    assert any(isinstance(layer, DynamicSlidingWindowLayer) for layer in new_kv_cache(config).layers)
    rewindable = new_kv_cache(config, rewindable=True)
    assert not any(isinstance(layer, DynamicSlidingWindowLayer) for layer in rewindable.layers)
    assert RecurrentState.save(rewindable) is None


def test_a_sliding_window_past_its_window_is_reused_only_whole():
    """gpt-oss's plain cache keeps the last window-1 positions of a sliding layer: it cannot be cut
    back to a shorter prompt (a regenerate), only extended (a new turn)."""
    model = build_tiny_model("gpt_oss")  # sliding_window 8
    ids = list(range(1, 13))
    kv_cache = new_kv_cache(model.config)
    _next_logits(model, kv_cache, ids[:4])
    assert is_croppable(kv_cache)
    _next_logits(model, kv_cache, ids[4:])
    assert not is_croppable(kv_cache)
    prefixes = PrefixCache()
    prefixes.put(ids, kv_cache, rewindable=False)
    assert prefixes.take(ids, rewindable=False) == (None, 0)  # regenerate: 11 of 12 is not possible
    prefixes.put(ids, kv_cache, rewindable=False)
    assert prefixes.take([*ids, 99], rewindable=False) == (kv_cache, len(ids))  # a new turn: whole
