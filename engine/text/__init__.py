"""Text at the engine's edges: prompts into ids, replies out of a token stream, reasoning apart.

- `stream`: a chat prompt into ids (the model's template), and streaming text out of a token
  stream (whole characters, stop strings held back until they can no longer match);
- `prompt_ids`: a request's prompt (ids, text or messages) as checked token ids, and the ids
  that end a reply;
- `reasoning`: a reply's reasoning apart from its answer (`<think>` blocks, gpt-oss's harmony
  channels), parsed from the stream.

May import: the engine's base modules (`errors`, `config`, `generation_config`) and the
tokenizer libraries. No torch model code: the rooms above call these on ids and text.
"""
