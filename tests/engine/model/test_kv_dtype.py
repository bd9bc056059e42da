"""--kv-dtype: the KV cache stored in another precision than the model computes in. A float32
cache of a float32 model changes nothing; bf16 and fp16 keep the tiny models' greedy replies
token for token; fp8 (float8_e4m3fn, per-head scales) stays within a measured logit bound; the
memory figures and the auto expert budget count the stored width."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine import loader
from engine.config import OffloadConfig
from engine.errors import InvalidRequestError
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.loader import load_model
from engine.model.hf_calls import with_cache
from engine.model.kv_cache import new_kv_cache
from engine.model.kv_size import KV_RESERVE_TOKENS, KvShape, kv_element_bytes, kv_reserve_bytes
from engine.options import add_offload_arguments, offload_config
from engine.tiny.models import build_tiny_model, make_tiny_model

PROMPT = list(range(3, 60))
GREEDY = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(greedy=True), ignore_eos=True)
# max |logit difference| from the float32 cache at the prompt's end, measured on these tiny models
# (qwen3_moe, gpt_oss): bf16 1.2e-3 / 2.4e-3, fp16 1.2e-4 / 1.6e-4, fp8 1.6e-2 / 3.8e-2
LOGIT_BOUND = {"bfloat16": 1e-2, "float16": 1e-3, "float8_e4m3fn": 0.1}
ELEMENT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ELEMENT["float8_e4m3fn"] = torch.float8_e4m3fn


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])  # gpt_oss: sliding-window layers
def folder(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def _run(folder, kv_dtype: str):
    """The greedy reply, the prompt's last logits and the cache that gave them."""
    model = load_model(folder, OffloadConfig(device="cpu", dtype="float32", kv_dtype=kv_dtype))
    try:
        reply = generate_text(model, PROMPT, GREEDY)
        kv_cache = model.new_kv_cache()
        logits = model.forward(torch.tensor(PROMPT), kv_cache)[-1]
        again = generate_text(model, PROMPT, GREEDY)  # from the kept cache: prefix reuse
    finally:
        model.close()
    return reply, logits, kv_cache, again


@pytest.fixture(scope="module")
def reference(folder):
    return _run(folder, "auto")


def _stored_bytes(kv_cache) -> int:
    return sum(layer.keys.numel() * layer.keys.element_size() for layer in kv_cache.layers)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "float8_e4m3fn"])
def test_a_narrower_cache_keeps_the_reply_and_stores_fewer_bytes(folder, reference, kv_dtype):
    reply, logits, kv_cache, again = _run(folder, kv_dtype)
    ref_reply, ref_logits, ref_cache, _ = reference
    assert all(layer.keys.dtype == ELEMENT[kv_dtype] for layer in kv_cache.layers)
    assert _stored_bytes(kv_cache) * 4 == _stored_bytes(ref_cache) * ELEMENT[kv_dtype].itemsize
    assert (logits - ref_logits).abs().max() <= LOGIT_BOUND[kv_dtype]
    if kv_dtype != "float8_e4m3fn":  # fp8 flips near-tied tokens of a random model: the bound above
        assert reply.token_ids == ref_reply.token_ids
    assert again.token_ids == reply.token_ids
    # a sliding window past its window is reused only whole (engine.model.kv_cache): not gpt_oss's here
    assert (again.stats.cached_prompt_tokens > 0) == folder.name.startswith("qwen3_moe")


def test_a_float32_cache_of_a_float32_model_changes_nothing(folder, reference):
    reply, logits, _, _ = _run(folder, "float32")
    assert reply.token_ids == reference[0].token_ids and torch.equal(logits, reference[1])


def test_the_storing_layer_asked_for_the_compute_dtype_is_exact():
    model = build_tiny_model("gpt_oss")  # sliding-window layers and full ones
    ids = torch.tensor([PROMPT])
    logits = []
    for kv_dtype in (None, torch.float32):
        kv_cache = new_kv_cache(model.config, kv_dtype=kv_dtype)
        with torch.inference_mode():
            logits.append(model(input_ids=ids, **with_cache(model, kv_cache, use_cache=True)).logits)
    assert torch.equal(*logits)


def test_the_kv_estimate_and_the_auto_budget_count_the_stored_width(monkeypatch):
    assert [kv_element_bytes(name, 4) for name in ("auto", "float32", "bfloat16", "float8_e4m3fn")] == [
        4,
        4,
        2,
        1,
    ]
    model = build_tiny_model("qwen3_moe")
    config = model.config.to_dict()
    window = config["max_position_embeddings"]
    assert window < KV_RESERVE_TOKENS  # the reserve is the model's whole window when that is shorter
    assert kv_reserve_bytes(config, 1) == KvShape.from_config(config).nbytes(window, 1) > 0
    assert kv_reserve_bytes({"hidden_size": 8}, 2) == 0  # a config it cannot read: no reserve

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 * 2**30, 16 * 2**30))
    cuda = torch.device("cuda")
    budgets = {
        kv: loader._auto_expert_nbytes(model, {}, cuda, kv) for kv in ("auto", "bfloat16", "float8_e4m3fn")
    }
    assert budgets["float8_e4m3fn"] - budgets["auto"] == kv_reserve_bytes(config, 4) - kv_reserve_bytes(
        config, 1
    )
    assert budgets["auto"] < budgets["bfloat16"] < budgets["float8_e4m3fn"]
    # a context length below the window reserves that many tokens' KV, and frees the rest for experts
    shorter = loader._auto_expert_nbytes(model, {}, cuda, "auto", context_length=16)
    element = kv_element_bytes("auto", model.dtype.itemsize)
    saved = kv_reserve_bytes(config, element) - kv_reserve_bytes(config, element, 16)
    assert shorter - budgets["auto"] == saved
    assert shorter > budgets["auto"]


def test_the_option_takes_short_names_and_a_wrong_one_is_refused():
    parser = argparse.ArgumentParser()
    add_offload_arguments(parser)
    assert offload_config(parser.parse_args(["--kv-dtype", "fp8"])).kv_dtype == "float8_e4m3fn"
    assert offload_config(parser.parse_args([])).kv_dtype == "auto"
    assert offload_config(parser.parse_args(["--ctx-size", "8192"])).context_length == 8192
    assert offload_config(parser.parse_args([])).context_length is None
    with pytest.raises(InvalidRequestError, match="KV cache dtype"):
        OffloadConfig(kv_dtype="int4").validate()
