"""Remote engines (DESIGN.md layer 11): any OpenAI-compatible server — vLLM or SGLang with expert
parallelism on a cluster, llama.cpp, Ollama, another MoE Chat — behind the local worker's protocol.

May import the base modules and `engine.worker` (the protocol and `EngineSession`), the `openai`
client and prometheus-client's parser; never torch and never Qt. The distributed engine is the
remote's; this room only talks to it.

Modules: `endpoint`, `worker` (`RemoteWorker`), `openai_chat` (one reply from the server, in the
worker protocol's terms), `session` (`connect`), `errors`, `metrics` (its /metrics), `stats`.

The public interface (what the GUI, the terminal chat and the Python API use):
- `RemoteEndpoint(name, base_url, model=None)`: a saved remote (`base_url` normalized to the API
  root; `metrics_url` its Prometheus /metrics). Keys are not here: `app.settings.remotes` keeps
  them in the OS keyring.
- `RemoteWorker(endpoint, api_key, timeouts)`: a drop-in for `WorkerProcess` (start, send, poll,
  alive, stop, kill, ready) — give `EngineClient(worker_factory=lambda: RemoteWorker(...),
  standby_factory=None)` and the GUI talks to the remote. `LoadModel.model_dir` is the remote's
  model id (None: the endpoint's default, else the first listed); `Loaded.model["remote"]` is True.
- `connect(url_or_endpoint, api_key, model)` → `RemoteSession`, an `EngineSession` (the Python API
  and the terminal chat).
- Events as the local engine's, plus: `Finished.tool_calls` (the remote's structured calls),
  `Finished.reason` "tool_calls" and "interrupted" (the stream was cut: the text received is in
  `Finished.text`, the cause in `Finished.stats["error"]`), `Error.kind` one of
  `engine.remote.errors`' kinds (`RETRYABLE` ones deserve a Retry button; retrying is sending the
  request again).
- `Stats.extra["remote"]`: client-side TTFT / tokens/s and the remote's `/metrics` (`RemoteMetrics`:
  KV-cache usage, running/waiting requests, speculative acceptance, expert-parallel balance), read
  typed with `remote_stats(stats)`; what a server does not export is None, never 0.
"""

import importlib
from typing import Any

# name -> module: imported on first use, so `engine.remote.endpoint` (the settings' import) does not
# pull in the openai client, slow to import, at the GUI's start
_EXPORTS = {
    "RemoteEndpoint": "endpoint",
    "normalize_base_url": "endpoint",
    "RETRYABLE": "errors",
    "RemoteError": "errors",
    "RemoteMetrics": "metrics",
    "fetch_metrics": "metrics",
    "parse_metrics": "metrics",
    "RemoteSession": "session",
    "connect": "session",
    "RemoteStats": "stats",
    "remote_stats": "stats",
    "RemoteTimeouts": "worker",
    "RemoteWorker": "worker",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"engine.remote.{_EXPORTS[name]}"), name)
