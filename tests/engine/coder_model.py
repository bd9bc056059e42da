"""A tiny model whose tokenizer has Qwen2.5-Coder's fill-in-the-middle tokens, as code models
name them, for the tests of a suffix filled in between (the byte-level tiny tokenizer: a byte a
token, then the three FIM tokens)."""

from pathlib import Path

from engine.tiny.models import build_tiny_model, save_tiny_model, tiny_tokenizer

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


def save_coder_model(folder: Path) -> Path:
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": FIM})
    model = build_tiny_model("qwen3_moe", vocab_size=len(tokenizer))
    return save_tiny_model(model, folder, tokenizer=tokenizer)
