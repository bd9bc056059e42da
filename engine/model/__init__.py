"""Reading models (DESIGN.md layers 1–2): checkpoints on disk and the architecture adapters.

- `checkpoint`: lazy safetensors reading, both expert layouts (per-expert and fused);
- `gguf_file`: a GGUF file memory-mapped, its config, tokenizer and tensors;
- `folder`: a model folder opened (which checkpoint, its tokenizer, derived configs);
- `derived_config`: configs derived for families transformers reads differently;
- `adapters/`: one small entry per Hugging Face `model_type` (where the MoE blocks are,
  the router rule, shared experts);
- `check`, `check_gguf`, `model_check`: a model folder's or GGUF file's completeness, without
  loading it, and the `ModelCheck` it gives;
- `fit_estimate`: whether a model fits this computer's RAM and GPU, and where it would live;
- `hf_calls`: the few transformers call conventions the engine relies on;
- `kv_cache`, `kv_size`, `prefix_cache`: the KV cache, its size, and the caches of the latest
  replies that a new turn reuses;
- `mtp_layer`: a checkpoint's own multi-token-prediction layer as a small resident module.

May import: the engine's base modules (`errors`, `config`, `generation_config`,
`resources`), torch, transformers, safetensors and gguf. Never the rooms above it.
"""
