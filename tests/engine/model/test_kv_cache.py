"""The engine's KV cache is the model's own, and goes back to a prefix, recurrent state included."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from engine.model.hf_calls import with_cache
from engine.model.kv_cache import (
    GROW_MIN_POSITIONS,
    GrowingLayer,
    RecurrentState,
    is_croppable,
    is_recurrent,
    new_kv_cache,
    rewind_cache,
)
from engine.model.prefix_cache import PrefixCache
from engine.tiny.models import build_tiny_model


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


def test_a_growing_layer_writes_steps_in_place_and_holds_what_concatenation_would():
    """Each step's positions go into the buffer in place (the keys keep their storage between
    steps) and the layer holds what transformers' concatenating DynamicLayer holds, through crops
    (a rejected draft), a step after a crop, growth past the buffer and keys replaced by another
    DynamicLayer method."""
    grown, reference = GrowingLayer(), DynamicLayer()
    generator = torch.Generator().manual_seed(0)

    def step(positions: int) -> None:
        keys, values = (torch.randn(1, 2, positions, 4, generator=generator) for _ in range(2))
        got, expected = grown.update(keys, values), reference.update(keys, values)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)

    step(5)  # a prompt
    storage = grown.keys.data_ptr()
    for _ in range(3):
        step(1)
    assert grown.keys.data_ptr() == storage  # written in place: no copy of the cache
    for layer in (grown, reference):
        layer.crop(-2)  # a rejected draft
    step(1)
    assert grown.get_seq_length() == reference.get_seq_length() == 7
    step(GROW_MIN_POSITIONS)  # past the buffer: moved into a bigger one
    assert grown.keys.data_ptr() != storage
    for layer in (grown, reference):
        layer.batch_select_indices(torch.tensor([0]))  # keys replaced by a new tensor
    step(2)
    assert torch.equal(grown.keys, reference.keys) and torch.equal(grown.values, reference.values)
    grown.reset()
    assert grown.get_seq_length() == 0 and grown._buffers is None


def test_a_producer_writing_the_buffers_leaves_the_layer_as_update_would():
    """`room` gives the buffers with room after the cached positions, a producer writes there and
    `written` counts them: keys, values and length are then what `update` would hold, through a
    crop (views set from outside) and a step that needs a larger buffer."""
    grown, reference = GrowingLayer(), DynamicLayer()
    generator = torch.Generator().manual_seed(1)

    def written(positions: int) -> None:
        keys, values = (torch.randn(1, 2, positions, 4, generator=generator) for _ in range(2))
        length = grown.get_seq_length()
        room = grown.room(positions)
        assert room is not None and room[0].shape[2] >= length + positions
        room[0][:, :, length : length + positions] = keys
        room[1][:, :, length : length + positions] = values
        grown.written(positions)
        reference.update(keys, values)
        assert grown.get_seq_length() == reference.get_seq_length()
        assert torch.equal(grown.keys, reference.keys) and torch.equal(grown.values, reference.values)

    assert GrowingLayer().room(1) is None  # nothing cached yet: the first write is an update's
    keys, values = (torch.randn(1, 2, 3, 4, generator=generator) for _ in range(2))
    grown.update(keys, values), reference.update(keys, values)
    for _ in range(3):
        written(1)
    for layer in (grown, reference):
        layer.crop(-2)
    written(2)
    written(GROW_MIN_POSITIONS)  # past the buffer: `room` moves the cache into a larger one
    batched = GrowingLayer()
    batched.update(torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))
    assert batched.room(1) is None  # several sequences: not a producer's
    grown.written(0)  # held, its views not made yet
    grown.reset()
    assert grown.get_seq_length() == 0 and grown.keys is None and grown.room(1) is None


def test_full_attention_layers_grow_in_place_and_sliding_ones_stay_transformers(qwen3_next):
    kv_cache = new_kv_cache(qwen3_next.config)
    assert {type(layer) for layer in kv_cache.layers if not is_recurrent(layer)} <= {GrowingLayer}
    assert any(type(layer) is GrowingLayer for layer in kv_cache.layers)
    stored = new_kv_cache(qwen3_next.config, kv_dtype=torch.bfloat16)
    assert all(isinstance(layer, GrowingLayer) for layer in stored.layers if not is_recurrent(layer))
