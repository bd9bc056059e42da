"""Incremental detokenization and stop strings, with tiny tokenizers built offline."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.errors import InvalidRequestError
from engine.text.stream import IncrementalDetokenizer, StopStringMatcher

TEXT = "Hello world! café 🌍 — 世界 the cat\nnew line  two spaces"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHARS = _bytes_to_unicode()


@pytest.fixture(scope="module")
def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """BPE over the 256 byte tokens with no merges: every UTF-8 byte is its own token."""
    vocab = {char: i for i, char in enumerate(sorted(BYTE_CHARS.values()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def _sentencepiece_tokenizer(decoder: decoders.Decoder) -> PreTrainedTokenizerFast:
    """Llama-style: ▁ marks a leading space, characters outside the vocab fall back to <0xNN> bytes."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    words = ["▁", "▁Hello", "▁world", "▁the", "▁cat", "▁caf", "▁new", "▁line", "▁two", "▁spaces", "é", "!"]
    letters = list("abcdefghijklmnopqrstuvwxyz\n")
    vocab = [(p, -10.0) for p in pieces] + [(w, -1.0) for w in words] + [(c, -5.0) for c in letters]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoder
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


LLAMA_DECODER = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
)
METASPACE_DECODER = decoders.Sequence(
    [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
)


def _stream(tokenizer, ids: list[int], **kwargs) -> tuple[list[str], str]:
    detokenizer = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detokenizer.push(token_id) for token_id in ids]
    tail = detokenizer.flush()
    assert detokenizer.text == "".join(deltas) + tail
    return deltas, tail


def _byte_ids(tokenizer, data: bytes) -> list[int]:
    return tokenizer.convert_tokens_to_ids([BYTE_CHARS[b] for b in data])


def test_multibyte_characters_span_several_byte_tokens(byte_level_tokenizer):
    for char, n_bytes in [("é", 2), ("世", 3), ("🌍", 4)]:
        assert len(byte_level_tokenizer.encode(char, add_special_tokens=False)) == n_bytes


def test_byte_level_deltas_are_complete_text(byte_level_tokenizer):
    ids = byte_level_tokenizer.encode(TEXT, add_special_tokens=False)
    deltas, tail = _stream(byte_level_tokenizer, ids)
    assert all(isinstance(d, str) and "\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == byte_level_tokenizer.decode(ids) == TEXT
    assert tail == ""
    for char in ("é", "🌍", "世", "界"):
        assert char in deltas  # each arrives whole, in the delta of its last byte


def test_incomplete_character_is_held_then_flushed_with_replacement(byte_level_tokenizer):
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer)
    ids = _byte_ids(byte_level_tokenizer, "a🌍".encode()[:3])  # 'a' and half an emoji
    assert [detokenizer.push(i) for i in ids] == ["a", "", ""]
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "a\ufffd"


@pytest.mark.parametrize("decoder", [LLAMA_DECODER, METASPACE_DECODER], ids=["llama", "metaspace"])
def test_sentencepiece_leading_spaces_survive_streaming(decoder):
    tokenizer = _sentencepiece_tokenizer(decoder)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert "▁world" in tokens and "<0xF0>" in tokens  # words with ▁ and byte fallback both occur
    deltas, tail = _stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == tokenizer.decode(ids) == TEXT
    assert " world" in deltas and " the" in deltas
    assert "🌍" in deltas


def test_special_tokens_are_skipped_or_kept(byte_level_tokenizer):
    eos = byte_level_tokenizer.eos_token_id
    ids = [*byte_level_tokenizer.encode("hi", add_special_tokens=False), eos]
    deltas, _ = _stream(byte_level_tokenizer, ids)
    assert "".join(deltas) == "hi"
    deltas, _ = _stream(byte_level_tokenizer, ids, skip_special_tokens=False)
    assert "".join(deltas) == "hi<eos>"


def test_literal_replacement_char_followed_by_text_is_emitted(byte_level_tokenizer):
    ids = byte_level_tokenizer.encode("x\ufffdyz", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer)
    deltas = [detokenizer.push(i) for i in ids]
    assert "".join(deltas) == "x\ufffdyz"  # nothing left for flush
    assert detokenizer.flush() == ""


def test_trailing_replacement_chars_do_not_stall_the_stream(byte_level_tokenizer):
    # A literal U+FFFD then lone continuation bytes: the text ends in U+FFFD after every token.
    data = "ok\ufffd".encode() + b"\x80" * 6 + "🌍!".encode()
    ids = _byte_ids(byte_level_tokenizer, data)
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer)
    emitted_before_emoji = "".join(detokenizer.push(i) for i in ids[: -len("🌍!".encode())])
    assert emitted_before_emoji.startswith("ok\ufffd\ufffd")  # released without waiting for flush
    deltas = [detokenizer.push(i) for i in ids[-len("🌍!".encode()) :]]
    text = emitted_before_emoji + "".join(deltas) + detokenizer.flush()
    assert text == byte_level_tokenizer.decode(ids) == data.decode(errors="replace")
    assert "🌍" in "".join(deltas)  # a real character after the run is never split


def test_released_replacement_run_never_splits_a_following_character(byte_level_tokenizer):
    data = b"\x80" * 5 + "🌍".encode() + b"\x80" * 4 + "世".encode()
    ids = _byte_ids(byte_level_tokenizer, data)
    deltas, tail = _stream(byte_level_tokenizer, ids)
    assert "".join(deltas) + tail == data.decode(errors="replace")
    assert any("🌍" in d for d in deltas) and any("世" in d for d in deltas)


class _CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call sees."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.decode_lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_decodes_a_small_window_not_the_whole_sequence(byte_level_tokenizer):
    ids = byte_level_tokenizer.encode(TEXT * 20, add_special_tokens=False)
    counting = _CountingTokenizer(byte_level_tokenizer)
    deltas, tail = _stream(counting, ids)
    assert "".join(deltas) + tail == TEXT * 20
    assert max(counting.decode_lengths) <= 8
    assert len(counting.decode_lengths) <= 2 * len(ids) + 2


def test_stop_string_split_across_deltas_is_never_emitted():
    matcher = StopStringMatcher(["<stop>"])
    assert matcher.feed("Hello <st") == ("Hello ", False)
    assert matcher.feed("op> ignored") == ("", True)
    assert matcher.matched == "<stop>"
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_stop_string_char_by_char():
    matcher = StopStringMatcher(["<stop>"])
    results = [matcher.feed(c) for c in "ab<stop>cd"]
    assert [text for text, _ in results[:2]] == ["a", "b"]
    assert all(result == ("", False) for result in results[2:7])
    assert results[7] == ("", True)


def test_partial_prefix_that_is_not_a_stop_string_is_emitted_in_full():
    matcher = StopStringMatcher(["<stop>"])
    assert matcher.feed("a <sto") == ("a ", False)
    assert matcher.feed("ck> b") == ("<stock> b", False)
    assert matcher.flush() == ""


def test_held_tail_restarts_inside_a_failed_prefix():
    matcher = StopStringMatcher(["aab"])
    assert matcher.feed("aa") == ("", False)
    assert matcher.feed("a") == ("a", False)  # "aa" may still start the stop string
    assert matcher.feed("b!") == ("", True)


def test_multiple_stop_strings_first_occurrence_wins():
    matcher = StopStringMatcher(["</s>", "\nUser:"])
    assert matcher.feed("answer\nUs") == ("answer", False)
    assert matcher.feed("er: hi </s>") == ("", True)
    assert matcher.matched == "\nUser:"

    matcher = StopStringMatcher(["ab", "b"])
    assert matcher.feed("cab") == ("c", True)
    assert matcher.matched == "ab"


def test_flush_returns_held_text():
    matcher = StopStringMatcher(["<stop>", "###"])
    assert matcher.feed("done <sto") == ("done ", False)
    assert matcher.feed("#") == ("<sto", False)
    assert matcher.flush() == "#"
    assert matcher.flush() == ""


def test_no_stop_strings_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything <stop>") == ("anything <stop>", False)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected():
    with pytest.raises(InvalidRequestError, match="stop strings"):
        StopStringMatcher(["ok", ""])


def test_detokenizer_and_stop_strings_together(byte_level_tokenizer):
    ids = byte_level_tokenizer.encode("Réponse: 世界<|end|> trailing", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(byte_level_tokenizer)
    matcher = StopStringMatcher(["<|end|>"])
    shown = []
    for token_id in ids:
        text, stopped = matcher.feed(detokenizer.push(token_id))
        shown.append(text)
        if stopped:
            break
    else:
        pytest.fail("the stop string was not found")
    assert "".join(shown) == "Réponse: 世界"


def test_the_backends_decode_serves_where_it_gives_the_tokenizers_text(byte_level_tokenizer):
    """A fast tokenizer's Rust backend decodes a reply's windows where transformers' wrapper would
    give the same text (no space clean-up: BPE never gets one); a WordPiece tokenizer that cleans
    up spaces keeps the wrapper, and both stream what the tokenizer decodes."""
    backend = byte_level_tokenizer.backend_tokenizer
    assert IncrementalDetokenizer(byte_level_tokenizer)._decode_ids == backend.decode
    vocab = {token: i for i, token in enumerate(["[UNK]", "hello", "world", "!", ",", "a"])}
    piece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    piece.pre_tokenizer = pre_tokenizers.Whitespace()
    piece.decoder = decoders.WordPiece()
    wordpiece = PreTrainedTokenizerFast(
        tokenizer_object=piece, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    assert IncrementalDetokenizer(wordpiece)._decode_ids == wordpiece.decode
    ids = wordpiece.encode("hello , world !", add_special_tokens=False)
    deltas, tail = _stream(wordpiece, ids)
    assert "".join(deltas) + tail == wordpiece.decode(ids, skip_special_tokens=True) == "hello, world!"
    ids = byte_level_tokenizer.encode(TEXT, add_special_tokens=False)
    assert "".join(_stream(byte_level_tokenizer, ids)[0]) == byte_level_tokenizer.decode(ids)
