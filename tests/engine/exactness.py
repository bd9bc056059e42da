"""The exactness check every checkpoint format shares: the engine's logits equal a transformers
reference model's (fp32, 1e-4) and its greedy tokens are the reference's, token for token."""

import torch

from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig


def assert_matches_reference(model, reference, prompt: list[int], new_tokens: int = 32) -> None:
    """`model` (an OffloadedModel) against `reference` (a transformers causal LM, eval, fp32);
    `new_tokens=0` compares the logits alone."""
    ids = torch.tensor(prompt)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = model.forward(ids, model.new_kv_cache(), logits_to_keep=0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    if not new_tokens:
        return
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
