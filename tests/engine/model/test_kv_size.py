"""`KvShape.from_config` counts what transformers' DynamicCache holds: full attention, sliding
windows (gpt-oss) and DeepSeek's MLA, on tiny models of each family."""

import pytest
import torch
from transformers import DynamicCache

from engine.model.hf_calls import with_cache
from engine.model.kv_size import KvShape
from engine.tiny.models import build_tiny_model


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("qwen3_moe", {}), ("gpt_oss", {"sliding_window": 8}), ("deepseek_v2", {})],
)
def test_the_kv_shape_counts_what_the_cache_holds(model_type, overrides):
    model = build_tiny_model(model_type, **overrides)
    shape = KvShape.from_config(model.config.to_dict())
    if model_type == "gpt_oss":
        assert shape.sliding_layers > 0 and shape.window == 8
    kv_cache = DynamicCache(config=model.config)
    tokens = 24
    with torch.no_grad():
        model(
            input_ids=torch.arange(tokens).view(1, -1) % 50 + 3, **with_cache(model, kv_cache, use_cache=True)
        )
    held = sum(t.numel() * t.element_size() for layer in kv_cache.layers for t in (layer.keys, layer.values))
    assert shape.nbytes(tokens, element_bytes=4) == held
