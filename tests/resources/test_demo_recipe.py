"""The demo models' recipe: the generated corpus, the tokenizer and the data pipeline."""

import importlib
import sys
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "resources" / "demo-moe"
sys.path.insert(0, str(RECIPE))
corpus = importlib.import_module("corpus")
train = importlib.import_module("train")


def test_corpus_is_deterministic_and_seeded():
    assert list(corpus.documents(0, 200)) == list(corpus.documents(0, 200))
    assert list(corpus.documents(0, 200)) != list(corpus.documents(1, 200))


def test_conversations_are_well_formed():
    chats = [d for d in corpus.documents(3, 2000) if isinstance(d, list)]
    assert 0.5 < len(chats) / 2000 < 0.7
    for chat in chats:
        roles = [m["role"] for m in chat if m["role"] != "system"]
        assert roles == ["user", "assistant"]
        assert all(m["content"].strip() == m["content"] and m["content"] for m in chat)


def test_heldout_prompts_never_appear_in_training():
    questions = {m["content"] for d in corpus.documents(0, 20000) if isinstance(d, list) for m in d}
    assert not set(corpus.heldout_prompts()) & questions


@pytest.fixture(scope="module")
def tokenizer():
    texts = [train.render(d) for d in corpus.documents(0, 3000)]
    return train.train_tokenizer(texts)


def test_training_text_matches_the_chat_template(tokenizer):
    """What the model is trained on is exactly what the engine will feed it at chat time."""
    chat = next(d for d in corpus.documents(5, 100) if isinstance(d, list))
    rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    assert train.render(chat) == rendered + "<|endoftext|>"
    prompt = tokenizer.apply_chat_template(chat[:-1], tokenize=False, add_generation_prompt=True)
    assert train.render(chat).startswith(prompt)


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(tokenizer):
    assert len(tokenizer) <= train.VOCAB_SIZE
    for special in train.SPECIAL_TOKENS:
        assert len(tokenizer(special)["input_ids"]) == 1
    for text in ("The cat says meow.", "héllo 🌍 世界", "  spaced\n\nlines\t"):
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>"


def test_token_blocks_cut_the_stream_into_sequences(tokenizer):
    texts = [train.render(d) for d in corpus.documents(9, 300)]
    blocks = train.token_blocks(tokenizer, texts)
    total = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    assert blocks.shape == (total // train.SEQ_LEN, train.SEQ_LEN)
    assert blocks[0, 0].item() == tokenizer(texts[0])["input_ids"][0]


@pytest.mark.slow
def test_quick_recipe_runs_end_to_end(tmp_path):
    code = train.main(
        ["--quick", "--documents", "600", "--target-steps", "3", "--draft-steps", "3", "--out", str(tmp_path)]
    )
    assert code == 0
    for name in ("target", "draft"):
        assert (tmp_path / name / "model.safetensors").is_file()
        assert (tmp_path / name / "tokenizer.json").is_file()
    assert (tmp_path / "train_log.json").is_file()
