"""The fixed prompts the benchmark and the tuner time, and the greedy request they run.

Lives below both `engine.bench` and `engine.tune` so that neither imports the other's
entry point for them.
"""

from __future__ import annotations

from engine.generation_config import GenerationConfig, SamplingConfig

PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "List three uses of a paperclip.",
    "What is the capital of France, and what river runs through it?",
)


def lengthened(ids: list[int], tokens: int) -> list[int]:
    """`ids` preceded by copies of themselves to `tokens` long: a prompt read after a long
    conversation, so that decode runs over a cache of that many positions."""
    if tokens <= len(ids):
        return list(ids)
    filler = ids * (-(-(tokens - len(ids)) // len(ids)))
    return filler[: tokens - len(ids)] + list(ids)


def encode_prompts(model, prompts) -> list[list[int]]:
    """Each prompt as the model's chat-templated token ids."""
    from engine.text.prompt_ids import encode_prompt  # imports transformers: only when a model is there

    if model.tokenizer is None:  # token-id-only checkpoints: a fixed id pattern of the same lengths
        vocab = model.hf_config.vocab_size
        return [[(i * 7 + len(p)) % vocab for i in range(len(p) // 4 + 8)] for p in prompts]
    return [encode_prompt(model, p) for p in prompts]


def greedy(new_tokens: int) -> GenerationConfig:
    """Greedy, exactly `new_tokens` long: the request every timed run makes."""
    return GenerationConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(greedy=True), ignore_eos=True)
