"""What the checkpoint-format tests share: the exactness check (the engine's logits equal a
transformers reference model's, fp32 1e-4, and its greedy tokens are the reference's, token
for token), the cache they run it with, and writing a folder in a published quantized format."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig


def assert_matches_reference(model, reference, prompt: list[int], new_tokens: int = 32) -> list[int]:
    """`model` (an OffloadedModel) against `reference` (a transformers causal LM, eval, fp32);
    `new_tokens=0` compares the logits alone. Returns the greedy tokens both gave."""
    ids = torch.tensor(prompt, device=reference.device)  # a reference on CUDA compares on CUDA
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = model.forward(ids, model.new_kv_cache(), logits_to_keep=0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    if not new_tokens:
        return []
    greedy = GenerationConfig(
        max_new_tokens=new_tokens, sampling=SamplingConfig(greedy=True), ignore_eos=True
    )
    tokens = generate_text(model, prompt, greedy).token_ids
    with torch.no_grad():
        reference_tokens = reference.generate(
            ids[None],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
        )[0, len(prompt) :]
    assert list(tokens) == reference_tokens.tolist()
    return list(tokens)


def quarter_cached(expert_dtype: str = "native") -> OffloadConfig:
    """The tiny models' 2 MoE layers × 8 experts with 4 slots: a quarter, and twice top-2."""
    return OffloadConfig(
        device="cpu",
        dtype="float32",
        expert_budget=ExpertBudget.parse("4"),
        sim_link_gbps=50.0,
        expert_dtype=expert_dtype,
    )


def save_published(folder: Path, tensors: dict, quantization_config: dict) -> None:
    """`tensors` as the folder's weights, and `quantization_config` in its config.json."""
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def assert_quarter_cached_equals(folder, reference_folder, prompt: list[int], tokens: int = 32) -> None:
    """The checkpoint in `folder`, loaded with a quarter of its experts cached, against transformers
    on `reference_folder` (the same weights dequantized): logits and `tokens` greedy tokens."""
    from transformers import AutoModelForCausalLM

    from engine.loader import load_model

    reference = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32).eval()
    model = load_model(folder, quarter_cached())
    try:
        assert model.cache.n_slots == 4 < model.store.total_experts  # the cache must evict
        assert_matches_reference(model, reference, prompt, tokens)
        assert model.cache.stats.total().misses > 4
    finally:
        model.close()
