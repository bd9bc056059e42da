"""MoE Chat's front-ends: the desktop GUI, the terminal chat and the local server.

- `gui/` — the PySide6 window; the only room that imports Qt;
- `terminal/` — the terminal chat (`moe-chat-cli`), no Qt;
- `server/` — the local OpenAI-compatible server (`moe-chat-cli serve`), no Qt;
- shared, Qt-free modules at this level: `settings`, `storage` (conversations), `catalog`
  (+ `catalog_checks`, what is wrong with an entry), `model_library`, `download_child`,
  `desktop_entry`, `markdown_render`, `session_setup` (a worker session from command-line
  options), `remote_setup` (the terminal chat on a remote engine); and `main`, the
  `moe-chat` entry point, which imports Qt only when it opens the window.

Nothing here imports torch, transformers or safetensors: front-ends talk to the
engine only through the worker protocol (`engine.worker.client`), so the window starts
fast and needs no CUDA context.
"""
