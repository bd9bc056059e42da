"""Offloaded execution equals transformers, for every architecture, policy and disk layout.

Each tiny model is built and saved in the test; the engine loads it with a
cache holding a quarter of the routed experts on the simulated link.
"""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import GenerationConfig, generate_text
from engine.generation_config import SpecConfig
from engine.loader import load_model
from engine.sampling import SamplingConfig
from engine.tiny.models import TINY_ARCHITECTURES, build_tiny_model, save_tiny_model

POLICIES = ("lru", "lfu", "mrs")
GREEDY_32 = GenerationConfig(max_new_tokens=32, sampling=SamplingConfig(greedy=True), ignore_eos=True)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """model_type -> (reference transformers model, folder per layout)."""
    models = {}
    for model_type in TINY_ARCHITECTURES:
        model = build_tiny_model(model_type, seed=1)
        folders = {
            layout: save_tiny_model(model, tmp_path_factory.mktemp(f"{model_type}-{layout}"), layout=layout)
            for layout in ("per_expert", "fused")
        }
        reference = AutoModelForCausalLM.from_pretrained(folders["per_expert"]).eval()
        models[model_type] = (reference, folders)
    return models


def quarter_cache(policy: str) -> OffloadConfig:
    # 2 MoE layers × 8 experts: 4 slots is a quarter, and twice top-2.
    return OffloadConfig(
        device="cpu", expert_budget=ExpertBudget(experts=4), policy=policy, sim_link_gbps=50.0
    )


def prompt_ids(vocab_size: int, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
@pytest.mark.parametrize("policy", POLICIES)
def test_logits_and_greedy_tokens_match_transformers(saved_models, model_type, policy):
    reference, folders = saved_models[model_type]
    model = load_model(folders["per_expert"], quarter_cache(policy))
    try:
        assert model.cache.n_slots == 4
        ids = prompt_ids(reference.config.vocab_size)
        with torch.no_grad():
            expected = reference(ids[None]).logits[0]
        logits = model.forward(ids, model.new_kv_cache(), logits_to_keep=0)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        assert model.cache.stats.total().misses > 4, "the cache must actually evict"

        with torch.no_grad():
            expected_ids = reference.generate(
                ids[None], max_new_tokens=32, do_sample=False, min_new_tokens=32, eos_token_id=None
            )[0, len(ids) :]
        finished = generate_text(model, ids.tolist(), GREEDY_32)
        assert list(finished.token_ids) == expected_ids.tolist()
        assert finished.stats.simulated_link
    finally:
        model.close()


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_fused_disk_layout_loads_the_same_model(saved_models, model_type):
    reference, folders = saved_models[model_type]
    per_expert = load_model(folders["per_expert"], quarter_cache("lru"))
    fused = load_model(folders["fused"], quarter_cache("lru"))
    try:
        assert fused.disk_layout.startswith("fused")
        if model_type != "gpt_oss":  # gpt-oss checkpoints are only ever fused
            assert per_expert.disk_layout != fused.disk_layout
        ids = prompt_ids(reference.config.vocab_size, seed=3)
        a = per_expert.forward(ids, per_expert.new_kv_cache(), logits_to_keep=0)
        b = fused.forward(ids, fused.new_kv_cache(), logits_to_keep=0)
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    finally:
        per_expert.close()
        fused.close()


def test_sharded_and_half_precision_checkpoints(tmp_path):
    model = build_tiny_model("qwen3_moe", seed=2)
    for dtype in (torch.bfloat16, torch.float16):
        folder = save_tiny_model(model, tmp_path / str(dtype), max_shard_size="60KB", dtype=dtype)
        assert (folder / "model.safetensors.index.json").is_file()
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        offloaded = load_model(
            folder, OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget(experts=4))
        )
        try:
            ids = prompt_ids(reference.config.vocab_size, seed=5)
            with torch.no_grad():
                expected = reference(ids[None]).logits[0]
            got = offloaded.forward(ids, offloaded.new_kv_cache(), logits_to_keep=0)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        finally:
            offloaded.close()


def test_auto_dtype_keeps_checkpoint_precision_when_asked(tmp_path):
    folder = save_tiny_model(build_tiny_model("mixtral"), tmp_path / "m", dtype=torch.bfloat16)
    model = load_model(
        folder, OffloadConfig(device="cpu", dtype="bfloat16", expert_budget=ExpertBudget(experts=4))
    )
    try:
        assert model.dtype == torch.bfloat16
        assert model.store.layout.fields[0].dtype == torch.bfloat16
        finished = generate_text(model, [1, 2, 3], GenerationConfig(max_new_tokens=4, ignore_eos=True))
        assert len(finished.token_ids) == 4
    finally:
        model.close()


def greedy_reference(reference, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' 32 greedy tokens after `ids`, and its logits at the first three of them."""
    with torch.no_grad():
        expected_ids = reference.generate(
            ids[None], max_new_tokens=32, do_sample=False, min_new_tokens=32, eos_token_id=None
        )[0, len(ids) :]
        return expected_ids, reference(torch.cat([ids, expected_ids[:3]])[None]).logits[0, len(ids) :]


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_experts_read_through_slot_tables_match_transformers(saved_models, model_type, monkeypatch):
    """A cache with a slot for every expert, filled (as CUDA's is at load; forced here on the CPU):
    one-token steps look their experts up on the device — the same logits and greedy tokens, with
    plain decoding and self-speculation; no host synchronisation in a decode step; every use a hit."""
    import engine.moe.layer as moe_layer
    from engine.bench.op_counts import HOST_READS, _value_reads

    resident = []
    real = moe_layer.forward_resident
    monkeypatch.setattr(moe_layer, "forward_resident", lambda *a: resident.append(a[0].layer) or real(*a))
    reference, folders = saved_models[model_type]
    model = load_model(
        folders["per_expert"], replace(quarter_cache("lru"), expert_budget=ExpertBudget(experts=16))
    )
    try:
        assert model.cache.holds_all and model.cache.fill() == 16
        model.control.grouped = True
        ids = prompt_ids(reference.config.vocab_size)
        expected_ids, expected = greedy_reference(reference, ids)
        cache = model.new_kv_cache()
        model.forward(ids, cache, logits_to_keep=1)  # the prefill (its last layer may keep one row)
        resident.clear()
        hits = model.cache.stats.phases["decode"].hits
        with torch.profiler.profile() as prof, _value_reads() as reads:
            logits = torch.cat([model.forward(expected_ids[i : i + 1], cache) for i in range(3)])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        assert resident == sorted(model.cache.store.layer_indices) * 3
        top_k = reference.config.num_experts_per_tok
        assert model.cache.stats.phases["decode"].hits == hits + len(resident) * top_k
        assert not sum(reads.values()) and not [e for e in prof.events() if e.name in HOST_READS]

        for spec in (SpecConfig(), SpecConfig(mode="self", adapt_draft_len=False)):
            finished = generate_text(model, ids.tolist(), replace(GREEDY_32, spec=spec))
            assert list(finished.token_ids) == expected_ids.tolist(), spec.mode
        total = model.cache.stats.total()
        assert total.misses == 16 and model.cache.stats.phases["load"].misses == 16  # only the fill's
    finally:
        model.close()


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_experts_computed_in_groups_match_transformers(saved_models, model_type, monkeypatch):
    """The grouped path (CUDA's default, forced here on the CPU): the same logits and greedy tokens,
    with plain decoding and with self-speculation's draft and verify steps, over a cache that
    evicts — and the groups were really taken. 12 of the 16 experts: each layer keeps 5, so a
    decode step's experts do not stream (a quarter cache streams every step)."""
    import engine.moe.batched_experts as grouped

    groups = []
    real = grouped.accumulate_together
    monkeypatch.setattr(grouped, "accumulate_together", lambda *a: groups.append(len(a[2])) or real(*a))
    reference, folders = saved_models[model_type]
    config = replace(quarter_cache("lru"), expert_budget=ExpertBudget(experts=12))
    model = load_model(folders["per_expert"], config)
    try:
        model.control.grouped = True
        ids = prompt_ids(reference.config.vocab_size)
        expected_ids, expected = greedy_reference(reference, ids)
        cache = model.new_kv_cache()
        model.forward(ids, cache, logits_to_keep=1)  # the prefill: experts one at a time
        logits = torch.cat([model.forward(expected_ids[i : i + 1], cache) for i in range(3)])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)  # decode steps, grouped
        assert groups, "decode steps must compute their experts in groups"

        for spec in (SpecConfig(), SpecConfig(mode="self", adapt_draft_len=False)):
            finished = generate_text(model, ids.tolist(), replace(GREEDY_32, spec=spec))
            assert list(finished.token_ids) == expected_ids.tolist(), spec.mode
        assert model.cache.stats.total().misses > 4, "the cache must actually evict"
    finally:
        model.close()
