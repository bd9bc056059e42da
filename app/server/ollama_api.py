"""Ollama's HTTP API beside OpenAI's, so that tools set up for Ollama (Open WebUI, editor plug-ins,
the `ollama` Python package) work against this server: `GET /api/version`, `/api/tags`, `/api/ps`,
`POST /api/show`, `/api/chat` and `/api/generate` as Ollama's docs/api.md has them, streamed as
newline-delimited JSON unless the request says `"stream": false`; `GET /` says "Ollama is running"
to the clients that probe it, and Ollama's other routes (pull, create, embed …) are a 404: the
server has the one model it loaded.

Nothing is generated here: a request becomes an OpenAI body (`app.server.ollama_requests`) that
the backend answers as it answers OpenAI's clients, and its reply or chunks become Ollama's. The
counts and durations come from the reply's usage and MoE Chat's stats: `eval_duration` is the
tokens over the decode speed the stats give (so a client's tokens per second is MoE Chat's), and
`prompt_eval_duration` the prefill's time (the prompt's tokens a kept cache held cost none: they are
`prompt_eval_cached_count`, as Ollama reports them); `load_duration` is 0 (the model is loaded with
the server). An error is Ollama's `{"error": message}` with its status, or a streamed reply's last
line once it started.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from app.server import ollama_requests
from app.server.http_io import json_body, ndjson_response, run_cancellable
from app.server.schemas import ApiError
from app.server.tool_calls import template_calls

# What `/api/version` answers: clients gate features on Ollama's version (tools, structured
# outputs, `think` since 0.9.0), and this server has what 0.9.0 has on these routes.
OLLAMA_VERSION = "0.9.0"
# What the backend does not say about the model is left empty rather than made up.
DETAILS = {
    "parent_model": "",
    "format": "",
    "family": "",
    "families": None,
    "parameter_size": "",
    "quantization_level": "",
}
DONE_REASONS = {"length": "length"}  # any other finish (stop, tool_calls) is Ollama's "stop"

Shape = Callable[[dict[str, Any]], dict[str, Any]]  # a reply's message → the route's fields


def add_routes(app: FastAPI, api) -> None:
    """Ollama's routes on `app`, answered by `api` (a `ChatBackend`, or a stand-in)."""

    @app.api_route("/", methods=["GET", "HEAD"])
    def running() -> Response:  # what Ollama's clients probe to find a server
        return PlainTextResponse("Ollama is running")

    @app.get("/api/version")
    def version() -> dict:
        return {"version": OLLAMA_VERSION}

    @app.get("/api/tags")
    def tags() -> dict:
        return {"models": [model_entry(api)]}

    @app.get("/api/ps")
    def loaded() -> dict:
        return {"models": [{**model_entry(api), "size_vram": 0}]}  # never expires: no expires_at

    @app.post("/api/show")
    async def show(request: Request) -> Response:
        return await _ollama_errors(_show(request, api))

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        return await _ollama_errors(_chat(request, api))

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        return await _ollama_errors(_generate(request, api))

    @app.api_route("/api/{path:path}", methods=["GET", "POST", "DELETE", "HEAD"])
    def unsupported(request: Request) -> Response:  # pull, create, embed …: one model, as loaded
        message = f"{request.method} {request.url.path} is not supported by this server"
        return JSONResponse({"error": message}, status_code=404)


async def _ollama_errors(reply: Awaitable[Response]) -> Response:
    try:
        return await reply
    except ApiError as err:
        return JSONResponse(error_line(err), status_code=err.status)


def error_line(err: ApiError) -> dict[str, str]:
    """Ollama's error body, and a streamed reply's last line when it fails."""
    return {"error": err.message}


def model_entry(api) -> dict[str, Any]:
    """The served model as `/api/tags` lists it."""
    info = api.model_info() or {}
    return {
        "name": api.model_id,
        "model": api.model_id,
        "modified_at": _rfc3339(api.created),
        "size": info.get("resident_nbytes", 0) + info.get("store_nbytes", 0),  # weights here and in RAM
        "digest": "",
        "details": model_details(info),
    }


def model_details(info: dict[str, Any]) -> dict[str, Any]:
    """Ollama's `details` from the loaded model's info: its format, family and precision (the
    experts' where they differ, as a quantization level names them); what is not known is empty."""
    family = info.get("model_type") or ""
    experts = info.get("expert_dtype") or "native"
    precision = info.get("dtype", "") if experts == "native" else experts
    return {
        **DETAILS,
        "format": ("gguf" if str(info.get("path", "")).endswith(".gguf") else "safetensors") if info else "",
        "family": family,
        "families": [family] if family else None,
        "quantization_level": precision.upper(),
    }


def model_facts(info: dict[str, Any]) -> dict[str, Any]:
    """Ollama's `model_info`, under the GGUF key names it uses: what the loaded model says."""
    family = info.get("model_type")
    if not family:
        return {}
    facts = {
        "context_length": info.get("context_length"),
        "block_count": info.get("num_layers"),
        "expert_count": info.get("num_experts"),
        "expert_used_count": info.get("top_k"),
    }
    return {"general.architecture": family} | {f"{family}.{k}": v for k, v in facts.items() if v is not None}


async def _show(request: Request, api) -> Response:
    show = ollama_requests.parse(ollama_requests.ShowRequest, await json_body(request))
    ollama_requests.check_model(show.model, api.model_id, ollama_requests.NOT_FOUND_TO_SHOW)
    info = api.model_info() or {}
    capabilities = ["completion", "tools", *(["thinking"] if info.get("thinks") else [])]
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": model_details(info),
            "model_info": model_facts(info),
            "capabilities": capabilities,
            "modified_at": _rfc3339(api.created),
        }
    )


async def _chat(request: Request, api) -> Response:
    started = time.monotonic_ns()
    chat = ollama_requests.parse(ollama_requests.ChatRequest, await json_body(request))
    ollama_requests.check_model(chat.model, api.model_id)
    if not chat.messages:  # Ollama's "load the model": it is loaded
        return JSONResponse(_loaded(chat.model, _chat_fields({"role": "assistant", "content": ""})))
    body = ollama_requests.chat_body(chat, api.model_id)
    if not chat.streamed:
        reply = await run_cancellable(lambda cancelled: api.complete(body, cancelled), request)
        return JSONResponse(whole_reply(reply, chat.model, _chat_fields, started))
    lines = reply_lines(api.stream(_streamed(body)), chat.model, _chat_fields, started)
    return await ndjson_response(lines, error_item=error_line)


async def _generate(request: Request, api) -> Response:
    started = time.monotonic_ns()
    generate = ollama_requests.parse(ollama_requests.GenerateRequest, await json_body(request))
    ollama_requests.check_model(generate.model, api.model_id)
    if not generate.prompt and not generate.suffix:  # Ollama's "load the model": it is loaded
        return JSONResponse(_loaded(generate.model, {"response": ""}))
    if generate.continues_text:
        body = ollama_requests.completion_body(generate, api.model_id, _server_max_tokens(api))
        whole, streamed, last = api.completion, api.completion_stream, {}
    else:  # a raw reply returns no context; the others an empty one (a next request's `context` is refused)
        body = ollama_requests.generate_chat_body(generate, api.model_id)
        whole, streamed, last = api.complete, api.stream, {"context": []}
    if not generate.streamed:
        reply = await run_cancellable(lambda cancelled: whole(body, cancelled), request)
        return JSONResponse({**whole_reply(reply, generate.model, _generate_fields, started), **last})
    lines = reply_lines(streamed(_streamed(body)), generate.model, _generate_fields, started, last)
    return await ndjson_response(lines, error_item=error_line)


def _server_max_tokens(api) -> int | None:
    """The server's reply length (`--max-new-tokens`), for a completions body: that API's own
    default (16 tokens) is not Ollama's, which has no limit of its own."""
    return api.defaults.max_new_tokens


def _streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def _chat_fields(message: dict[str, Any]) -> dict[str, Any]:
    return {"message": message}


def _generate_fields(message: dict[str, Any]) -> dict[str, Any]:
    thinking = {"thinking": message["thinking"]} if "thinking" in message else {}
    return {"response": message["content"], **thinking}


def _loaded(model: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {"model": model, "created_at": _rfc3339(), **fields, "done": True, "done_reason": "load"}


def whole_reply(reply: dict[str, Any], model: str, shape: Shape, started_ns: int) -> dict[str, Any]:
    """A whole OpenAI reply (chat or text completion) as Ollama's."""
    choice = reply["choices"][0]
    return {
        "model": model,
        "created_at": _rfc3339(),
        **shape(ollama_message(choice)),
        **_logprobs(choice),
        **done_fields(choice.get("finish_reason"), reply.get("usage"), reply.get("stats"), started_ns),
    }


def reply_lines(
    chunks: Iterator[dict[str, Any]], model: str, shape: Shape, started_ns: int, last: dict | None = None
) -> Iterator[dict[str, Any]]:
    """Ollama's lines for an OpenAI reply's chunks: one a chunk that says something, then the last
    with the counts (and `last`); closing them closes the chunks, which cancels the generation."""
    reason, usage, stats = None, None, None
    with contextlib.closing(chunks):
        for chunk in chunks:
            usage, stats = chunk.get("usage") or usage, chunk.get("stats") or stats
            for choice in chunk.get("choices") or ():
                reason = choice.get("finish_reason") or reason
                message, logprobs = ollama_message(choice), _logprobs(choice)
                if message.keys() - {"role", "content"} or message["content"] or logprobs:
                    yield {
                        "model": model,
                        "created_at": _rfc3339(),
                        **shape(message),
                        "done": False,
                        **logprobs,
                    }
    end = shape({"role": "assistant", "content": ""})
    yield {
        "model": model,
        "created_at": _rfc3339(),
        **end,
        **done_fields(reason, usage, stats, started_ns),
        **(last or {}),
    }


def ollama_message(choice: dict[str, Any]) -> dict[str, Any]:
    """A choice's message or delta (or a text completion's text) as Ollama's message: reasoning
    is `thinking`, and a call's arguments an object (a call cut by the token limit keeps its
    arguments' JSON text as far as it got)."""
    part = choice.get("message") or choice.get("delta") or {"content": choice.get("text")}
    message = {"role": "assistant", "content": part.get("content") or ""}
    if part.get("reasoning_content"):
        message["thinking"] = part["reasoning_content"]
    if part.get("tool_calls"):
        calls = template_calls(part["tool_calls"])
        message["tool_calls"] = [
            {"function": {k: c["function"][k] for k in ("name", "arguments")}} for c in calls
        ]
    return message


def _logprobs(choice: dict[str, Any]) -> dict[str, Any]:
    """A chat choice's logprobs, whose entries are Ollama's already (token, logprob, bytes, top)."""
    entries = (choice.get("logprobs") or {}).get("content")
    return {"logprobs": entries} if entries else {}


def done_fields(
    reason: str | None, usage: dict | None, stats: dict | None, started_ns: int
) -> dict[str, Any]:
    """The end of a reply: why it stopped, and its counts and durations in nanoseconds (0 where
    the stats do not say)."""
    usage, stats = usage or {}, stats or {}
    prompt = usage.get("prompt_tokens", 0)  # the whole prompt, as Ollama counts it since 0.30
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0  # not prefilled again
    generated = usage.get("completion_tokens", 0)
    return {
        "done": True,
        "done_reason": DONE_REASONS.get(reason, "stop"),
        "total_duration": time.monotonic_ns() - started_ns,
        "load_duration": 0,
        "prompt_eval_count": prompt,
        **({"prompt_eval_cached_count": cached} if cached else {}),
        "prompt_eval_duration": _nanoseconds(prompt - cached, stats.get("prefill_tokens_per_s")),
        "eval_count": generated,
        "eval_duration": _nanoseconds(generated, stats.get("tokens_per_s")),
    }


def _nanoseconds(tokens: int, tokens_per_s: float | None) -> int:
    return round(tokens / tokens_per_s * 1e9) if tokens_per_s else 0


def _rfc3339(timestamp: float | None = None) -> str:
    """A time (now, by default) as Ollama writes it: RFC 3339, UTC."""
    moment = datetime.now(UTC) if timestamp is None else datetime.fromtimestamp(timestamp, UTC)
    return moment.isoformat().replace("+00:00", "Z")
