"""The local OpenAI-compatible server (`moe-chat-cli serve`), with Ollama's API beside it.

`openai_server` is the HTTP app and its command line; `openai_api` the chat-completions API over an
engine (an `EngineSession`, or the window's) without HTTP; `replies` the shapes responses share
(envelope, chunk, usage, MoE Chat's stats); `schemas` the requests as pydantic models and OpenAI's
error shapes; `tool_calls` a reply's calls as OpenAI's `tool_calls`; `request_config` a checked
request and its generation settings (sampling, stop strings, `n` choices); `completions_api` the
legacy `/v1/completions` (a prompt continued as written, fill-in-the-middle, echo); `responses_api`
the Responses API (`/v1/responses`) as a translation onto chat completions, and `responses_items`
its response objects and streamed events made of chat replies; `ollama_api` Ollama's `/api/…`
routes as a translation onto the same backend, and `ollama_requests` their requests as pydantic
models and the OpenAI bodies they become; `http_io`
what every route does over HTTP (JSON bodies, cancellable replies, SSE and NDJSON streams).

No Qt and no torch: requests go to the worker through `engine.worker.client`.
"""
