"""A request's prompt as the model's token ids, and the ids that end a reply.

`encode_prompt` takes token ids as they are, a completion prompt as written (a suffix in the
model's fill-in-the-middle format), a string as one user message and messages through
the model's chat template (`stream.encode_chat`), and refuses what cannot be tokenized or lies
outside the vocabulary; `eos_token_ids` are the ids the model's generation config and tokenizer
name as the end of a reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import GenerationConfig as HFGenerationConfig

from engine.errors import InvalidRequestError
from engine.generation_config import CompletionPrompt, is_unicode
from engine.text.reasoning import harmony_splitter_for, one_call_per_message
from engine.text.stream import encode_chat

Message = dict[str, str]

# Fill-in-the-middle tokens (prefix, suffix, middle) as the code models that have them name them;
# each writes PREFIX_TOKEN prefix SUFFIX_TOKEN suffix MIDDLE_TOKEN and generates the middle.
FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, Granite Code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


def encode_prompt(
    model: Any,
    prompt: str | Sequence[Message] | Sequence[int] | CompletionPrompt,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids for a prompt: ids pass through; a completion prompt is its text as written (its
    control tokens read as such), in the fill-in-the-middle format when it has a suffix; a string
    is one user message through the chat template when the tokenizer has one (else raw text);
    messages go through the template (given `template_kwargs`), with control tokens typed in a
    message kept as plain text (see `encode_chat`)."""
    if isinstance(prompt, CompletionPrompt):
        ids = _completion_ids(model, prompt)
    elif not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        tokenizer = model.tokenizer
        if tokenizer is None:
            raise InvalidRequestError(f"{model.path} has no tokenizer: give the prompt as token ids.")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        _check_unicode(messages)
        if harmony_splitter_for(tokenizer) is not None:
            messages = one_call_per_message(messages)  # as gpt-oss's template renders them
        if tokenizer.chat_template:
            ids = encode_chat(tokenizer, messages, **(template_kwargs or {}))
        elif isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            raise InvalidRequestError("This model has no chat template: give the prompt as plain text.")
    if not ids:
        raise InvalidRequestError("The prompt is empty.")
    vocab = model.hf_config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise InvalidRequestError(
            f"Prompt token id {bad[0]} is outside this model's vocabulary [0, {vocab})."
        )
    return list(ids)


def _completion_ids(model: Any, prompt: CompletionPrompt) -> list[int]:
    if prompt.text is None:
        if prompt.suffix is not None:
            raise InvalidRequestError("A suffix needs the prompt as text, not as token ids.")
        return list(prompt.token_ids)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InvalidRequestError(f"{model.path} has no tokenizer: give the prompt as token ids.")
    _check_unicode([{"prompt": prompt.text, "suffix": prompt.suffix or ""}])
    if prompt.suffix is None:
        return tokenizer(prompt.text)["input_ids"]
    fim = fill_in_middle_tokens(tokenizer)
    prefix, suffix, middle = tokenizer.convert_tokens_to_ids(list(fim))
    start = tokenizer("")["input_ids"]  # what the tokenizer puts before any text (a BOS, or nothing)
    text = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in (prompt.text, prompt.suffix)]
    return [*start, prefix, *text[0], suffix, *text[1], middle]


def fill_in_middle_tokens(tokenizer: Any) -> tuple[str, str, str]:
    """The tokenizer's fill-in-the-middle tokens (prefix, suffix, middle); a model without them
    cannot take a suffix."""
    vocab = tokenizer.get_vocab()
    for tokens in FIM_TOKENS:
        if all(t in vocab for t in tokens):
            return tokens
    raise InvalidRequestError(
        f"This model's tokenizer has no fill-in-the-middle tokens (such as {' '.join(FIM_TOKENS[0])}), "
        "so it cannot complete between a prompt and a suffix: leave out the suffix, or use a code model "
        "that has them."
    )


def _check_unicode(messages: Sequence[Message]) -> None:
    """A lone surrogate (JSON's "\\ud800") cannot be tokenized, logged or sent back: refuse it."""
    for n, message in enumerate(messages, start=1):
        for text in message.values():
            if isinstance(text, str) and not is_unicode(text):
                at = next(i for i, char in enumerate(text) if not is_unicode(char))
                raise InvalidRequestError(
                    f"Message {n} contains text that is not valid Unicode (a lone surrogate at "
                    f"character {at}): send the text as UTF-8 or remove the broken character."
                )


def eos_token_ids(model: Any) -> set[int]:
    ids: set[int] = set()
    try:
        gen_config = HFGenerationConfig.from_pretrained(model.path)
    except OSError:
        gen_config = HFGenerationConfig.from_model_config(model.hf_config)
    for source in (gen_config.eos_token_id, getattr(model.tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids
