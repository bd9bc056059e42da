"""A tiny gpt_oss model that speaks harmony as gpt-oss does: the control tokens are special tokens
of its vocabulary, `<|return|>` and `<|call|>` end a reply, and its chat template renders the
request's tools, an assistant's tool calls and the tools' results the way gpt-oss's own template
does (written here for the parts a tool round trip needs; the real one also renders the tools'
TypeScript signatures, built-in tools and the date):

    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{args}<|call|>
    <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>"result"<|end|>
"""

import json
from pathlib import Path

from engine.text.reasoning import HARMONY
from engine.tiny.gguf_writer import demo_tokenizer
from engine.tiny.models import build_tiny_model, save_tiny_model

HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final."
    "{%- if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{% endif %}"
    "<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n"
    "{%- for tool in tools %}\ntype {{ tool.function.name }} = (_: "
    "{{ tool.function.parameters | default({}) | tojson }}) => any;{% endfor %}\n"
    "} // namespace functions<|end|>{% endif %}"
    "{%- set last_call = namespace(name=none) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- set call = message.tool_calls[0].function %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>{%- set last_call.name = call.name %}"
    "{%- elif message.role == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'tool' %}"
    "<|start|>functions.{{ last_call.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ message.content | tojson }}<|end|>"
    "{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def harmony_tokenizer():
    """The demo tokenizer with harmony's control tokens as special tokens and the template above."""
    tokenizer = demo_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY)})
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


def save_harmony_model(folder: Path) -> Path:
    """A tiny gpt_oss checkpoint with that tokenizer; its replies end at `<|return|>` or `<|call|>`."""
    tokenizer = harmony_tokenizer()
    model = build_tiny_model("gpt_oss", vocab_size=len(tokenizer))
    save_tiny_model(model, folder, tokenizer=tokenizer)
    ends = [tokenizer.convert_tokens_to_ids(token) for token in ("<|return|>", "<|call|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return folder
