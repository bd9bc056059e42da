"""A tiny model that thinks as Qwen3.5/3.6 do: `<think>`/`</think>` are tokens of its vocabulary
and its chat template opens the block in the prompt unless `enable_thinking` is false (then it
writes an empty block), and drops earlier replies' thinking from the history."""

from pathlib import Path

from engine.tiny.gguf_writer import demo_tokenizer
from engine.tiny.models import build_tiny_model, save_tiny_model

QWEN_THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- else %}{%- set content = message.content %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


def thinking_tokenizer():
    """The demo tokenizer with the think tags as tokens of their own, and the template above."""
    tokenizer = demo_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN_THINKING_TEMPLATE
    return tokenizer


def save_thinking_model(folder: Path) -> Path:
    tokenizer = thinking_tokenizer()
    model = build_tiny_model("qwen3_moe", vocab_size=len(tokenizer))
    return save_tiny_model(model, folder, tokenizer=tokenizer)
