"""A request's prompt as the model's token ids, and the ids that end a reply.

`encode_prompt` takes token ids as they are, a string as one user message and messages through
the model's chat template (`stream.encode_chat`), and refuses what cannot be tokenized or lies
outside the vocabulary; `eos_token_ids` are the ids the model's generation config and tokenizer
name as the end of a reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import GenerationConfig as HFGenerationConfig

from engine.errors import InvalidRequestError
from engine.generation_config import is_unicode
from engine.text.reasoning import harmony_splitter_for, one_call_per_message
from engine.text.stream import encode_chat

Message = dict[str, str]


def encode_prompt(
    model: Any,
    prompt: str | Sequence[Message] | Sequence[int],
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids for a prompt: ids pass through; a string is one user message through the chat
    template when the tokenizer has one (else raw text); messages go through the template (given
    `template_kwargs`), with control tokens typed in a message kept as plain text (see `encode_chat`)."""
    if not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt):
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
