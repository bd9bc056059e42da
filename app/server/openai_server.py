"""Local OpenAI-compatible server: `moe-chat-cli serve [--port 8000] [--model DIR] [options]`.

Serves `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`,
`POST /v1/chat/completions` (a JSON response, or server-sent events with
`"stream": true`), `POST /v1/completions` (`completions_api`), `POST /v1/responses`
(`responses_api`) and Ollama's `/api/…` routes (`ollama_api`) for the one loaded model, on the
stack vLLM, SGLang and llama.cpp's Python server use: Starlette/FastAPI on uvicorn, requests
checked as pydantic models (`app.server.schemas`), events through `sse-starlette`
(`app.server.http_io`).

It listens on 127.0.0.1 only and answers only requests addressed to it by that
name (`TrustedHostMiddleware`: a web page cannot reach it through DNS rebinding);
a POST from a web page (one with an `Origin`) must be `application/json`, so no
preflight-free cross-origin request gets in;
`--api-key` asks for `Authorization: Bearer KEY`. Query strings are never logged.
A client that disconnects cancels its generation, streamed or not. The API itself
is `app.server.openai_api`.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware

from app.server import completions_api, ollama_api, responses_api
from app.server.http_io import openai_reply
from app.server.schemas import ApiError
from app.session_setup import (
    SERVED_MAX_TOKENS,
    add_session_arguments,
    model_id,
    open_session,
    report_start_failure,
)
from engine.errors import EngineError
from engine.generation_config import GenerationConfig

log = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1"}
API_KEY_ENV = "MOE_CHAT_API_KEY"


class HostNotAllowed(ValueError):
    pass


def loopback_address(host: str) -> str:
    """The address to bind for `host`; anything but this computer raises `HostNotAllowed`."""
    address = LOOPBACK.get(host.strip().lower())
    if address is None:
        raise HostNotAllowed(
            f"Refusing to listen on {host!r}: the server only listens on 127.0.0.1 (this computer). "
            "Use --host 127.0.0.1 or leave --host out."
        )
    return address


class ChatApi(Protocol):
    """What the routes ask of the API (`ChatBackend`, or a stand-in in tests)."""

    model_id: str  # the served model's name
    defaults: GenerationConfig  # what a request leaves out

    def models(self) -> dict[str, Any]: ...
    def model_info(self) -> dict[str, Any] | None: ...
    def model_card(self, model_id: str | None = None) -> dict[str, Any]: ...
    def health(self) -> tuple[int, dict[str, Any]]: ...
    def complete(self, body: object, cancelled: threading.Event | None = None) -> dict[str, Any]: ...
    def stream(self, body: object) -> Iterator[dict[str, Any]]: ...
    def completion(self, body: object, cancelled: threading.Event | None = None) -> dict[str, Any]: ...
    def completion_stream(self, body: object) -> Iterator[dict[str, Any]]: ...


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def create_app(api: ChatApi, api_key: str | None = None) -> FastAPI:
    """The ASGI app around one `ChatApi`."""
    app = FastAPI(title="MoE Chat", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(LOOPBACK))
    app.add_middleware(Guard, api_key=api_key)  # outermost: every request is logged, then checked

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        if err.status_code == 404:
            message, code = f"Unknown route: {request.method} {request.url.path}.", "unknown_url"
        elif err.status_code == 405:
            message, code = (
                f"{request.url.path} does not take {request.method} requests.",
                "method_not_allowed",
            )
        else:
            message, code = str(err.detail), None
        return error_response(ApiError(err.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=err)
        return error_response(ApiError(500, "Internal server error; see the server's log.", "server_error"))

    @app.get("/v1/models")
    def models() -> dict:
        return api.models()

    @app.get("/v1/models/{model_id:path}")
    def model_card(model_id: str) -> dict:
        return api.model_card(model_id)

    @app.get("/health")
    def health() -> JSONResponse:
        status, body = api.health()
        return JSONResponse(body, status_code=status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await openai_reply(request, api, "complete", "stream")

    for other in (completions_api, responses_api, ollama_api):
        other.add_routes(app, api)
    return app


class Guard:
    """Pure ASGI middleware (a `BaseHTTPMiddleware` would hide a client's disconnect from the
    routes): logs each request's method, path and status, never its query string (it may hold
    a key); with an API key, answers 401 unless `Authorization: Bearer KEY` matches."""

    def __init__(self, app, api_key: str | None = None):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, started = {}, time.monotonic()

        async def record(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        if self.api_key is not None and not _authorized(Headers(scope=scope), self.api_key):
            error = ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
            ollama = scope["path"].startswith("/api/")  # Ollama's clients read {"error": message}
            reply = JSONResponse({"error": error.message}, 401) if ollama else error_response(error)
            await reply(scope, receive, record)
        else:
            await self.app(scope, receive, record)
        took = time.monotonic() - started
        log.info("%s %s %s in %.2f s", scope["method"], scope["path"], status.get("code", "-"), took)


def _authorized(headers: Headers, api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())


class ApiServer:
    """uvicorn serving `create_app(api)` on 127.0.0.1; port 0 picks a free port (see `url`)."""

    def __init__(self, api: ChatApi, port: int = 8000, host: str = "127.0.0.1", api_key: str | None = None):
        config = uvicorn.Config(
            create_app(api, api_key),
            host=loopback_address(host),
            port=port,
            access_log=False,  # its lines carry query strings (?api_key=…); `guard` logs paths only
            log_level="warning",
            backlog=256,
            timeout_graceful_shutdown=5,
            h11_max_incomplete_event_size=64 * 1024,
        )
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}/v1"

    @property
    def address(self) -> tuple[str, int]:
        return self.server.servers[0].sockets[0].getsockname()[:2]

    def start(self, timeout_s: float = 30.0) -> ApiServer:
        """Serve from a thread; returns once the socket listens. A port that cannot be had (in use,
        not allowed) raises `OSError` here, before any thread starts."""
        config = self.server.config
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if os.name != "nt":  # as uvicorn does; on Windows it would let two servers share the port
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((config.host, config.port))
        except OSError:
            sock.close()
            raise
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="api-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError("The server did not start.")
            time.sleep(0.02)
        return self

    def wait(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` while it serves; False once it has stopped."""
        self._thread.join(timeout_s)
        return self._thread.is_alive()

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-chat-cli serve",
        description="A local OpenAI-compatible server (chat completions) for a Mixture-of-Experts model. "
        "The sampling options are the defaults for what a request leaves out.",
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="127.0.0.1 or localhost: nothing else is allowed")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every request (default: ${API_KEY_ENV}, else none)",
    )
    add_session_arguments(parser, max_new_tokens=SERVED_MAX_TOKENS)
    return parser


def main(argv: list[str] | None = None) -> int:
    multiprocessing.freeze_support()
    args = build_parser().parse_args(argv)
    try:
        loopback_address(args.host)  # before the engine takes seconds to start
    except HostNotAllowed as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # see app.terminal.chat.main
    try:
        session, _, defaults = open_session(args)
    except (EngineError, KeyboardInterrupt) as err:
        return report_start_failure(err)
    from app.server.openai_api import ChatBackend

    name = model_id(args.model)
    backend = ChatBackend(session, name, defaults)
    server = ApiServer(backend, args.port, args.host, args.api_key)
    try:
        server.start()
    except OSError as err:
        backend.close()
        session.close()
        print(f"error: cannot listen on 127.0.0.1:{args.port}: {err}", file=sys.stderr)
        return 1
    print(f"Serving {name} at {server.url} (OpenAI-compatible). Ctrl-C stops.", flush=True)
    try:
        while server.wait(0.5):
            pass
    except KeyboardInterrupt:
        print("Stopping.", file=sys.stderr)
    finally:
        server.stop()
        backend.close()
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
