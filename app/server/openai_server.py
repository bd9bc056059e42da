"""Local OpenAI-compatible server: `moe-chat-cli serve [--port 8000] [--model DIR] [options]`.

Serves `GET /v1/models`, `GET /v1/models/{id}` and `POST /v1/chat/completions`
(a JSON response, or server-sent events with `"stream": true`) for the one
loaded model. It has no authentication, so it listens on 127.0.0.1 only and
refuses any other host. The standard library's `ThreadingHTTPServer` gives each
connection a thread; requests wait their turn for the engine, which runs one at
a time. A client that disconnects mid-stream cancels its generation: the next
write fails and the chunk stream is closed. The API itself is `app.server.openai_api`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import multiprocessing
import signal
import sys
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from app.server.openai_api import ApiError, ChatBackend
from app.session_setup import add_session_arguments, model_id, open_session, report_start_failure
from engine.errors import EngineError

log = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1"}
MAX_BODY_BYTES = 16 * 1024**2


class HostNotAllowed(ValueError):
    pass


def loopback_address(host: str) -> str:
    """The address to bind for `host`; anything but this computer raises `HostNotAllowed`."""
    address = LOOPBACK.get(host.strip().lower())
    if address is None:
        raise HostNotAllowed(
            f"Refusing to listen on {host!r}: the server has no authentication, so it only listens "
            "on 127.0.0.1 (this computer). Use --host 127.0.0.1 or leave --host out."
        )
    return address


class ChatApi(Protocol):
    """What the handler asks of the API (`ChatBackend`, or a stand-in in tests)."""

    def models(self) -> dict[str, Any]: ...
    def model_card(self, model_id: str | None = None) -> dict[str, Any]: ...
    def complete(self, body: object) -> dict[str, Any]: ...
    def stream(self, body: object) -> Iterator[dict[str, Any]]: ...


class ApiServer(ThreadingHTTPServer):
    """The HTTP server around one `ChatApi`; port 0 picks a free port (see `url`)."""

    daemon_threads = True  # a stuck client never keeps the process from exiting

    def __init__(self, api: ChatApi, port: int = 8000, host: str = "127.0.0.1"):
        self.api = api
        super().__init__((loopback_address(host), port), ApiRequestHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


class ApiRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive for JSON responses; an event stream closes its connection
    server: ApiServer

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def _handle(self, method: str) -> None:
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        try:
            self._route(method, path)
        except ConnectionError:  # BrokenPipe, ConnectionReset: the client went away
            self._client_gone(method, path)
        except ApiError as err:
            self._send_error(err, method, path)
        except Exception:  # a bug: answer 500 and keep serving
            log.exception("%s %s failed", method, path)
            error = ApiError(500, "Internal server error; see the server's log.", "server_error")
            self._send_error(error, method, path)

    def _send_error(self, err: ApiError, method: str, path: str) -> None:
        try:
            self._send_json(err.status, err.body())
        except ConnectionError:
            self._client_gone(method, path)

    def _client_gone(self, method: str, path: str) -> None:
        log.info("%s %s: the client disconnected", method, path)
        self.close_connection = True

    def _route(self, method: str, path: str) -> None:
        api = self.server.api
        if path == "/v1/chat/completions":
            _allow(method, "POST", path)
            body = self._read_json()
            if isinstance(body, dict) and body.get("stream") is True:
                self._send_stream(api.stream(body))
            else:
                self._send_json(200, api.complete(body))
        elif path == "/v1/models":
            _allow(method, "GET", path)
            self._send_json(200, api.models())
        elif path.startswith("/v1/models/"):
            _allow(method, "GET", path)
            self._send_json(200, api.model_card(urllib.parse.unquote(path.removeprefix("/v1/models/"))))
        else:
            raise ApiError(404, f"Unknown route: {method} {path}.", code="unknown_url")

    def _read_json(self) -> object:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "The request needs a Content-Length header.") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.")
        data = self.rfile.read(length)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ApiError(400, f"We could not parse the JSON body of your request: {err}.") from None

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:  # the body may be unread: never reuse the connection after an error
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _send_stream(self, chunks: Iterator[dict[str, Any]]) -> None:
        """Server-sent events; closing `chunks` (always, also on a failed write) cancels the rest."""
        with contextlib.closing(chunks):
            first = next(chunks)  # an error until here still gets its own status and a JSON body
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")  # the end of the stream is the end of the connection
            self.close_connection = True
            self.end_headers()
            try:
                for chunk in itertools.chain([first], chunks):
                    self._send_event(json.dumps(chunk, ensure_ascii=False))
            except ApiError as err:  # the status is sent already: OpenAI's clients read an error event
                self._send_event(json.dumps(err.body(), ensure_ascii=False))
                return
            self._send_event("[DONE]")

    def _send_event(self, data: str) -> None:
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)


def _allow(method: str, allowed: str, path: str) -> None:
    if method != allowed:
        raise ApiError(405, f"{path} takes {allowed} requests, not {method}.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-chat-cli serve",
        description="A local OpenAI-compatible server (chat completions) for a Mixture-of-Experts model. "
        "The sampling options are the defaults for what a request leaves out.",
    )
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="127.0.0.1 or localhost: nothing else is allowed")
    add_session_arguments(parser, max_new_tokens=512)
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
    name = model_id(args.model)
    try:
        server = ApiServer(ChatBackend(session, name, defaults), args.port, args.host)
    except OSError as err:
        session.close()
        print(f"error: cannot listen on 127.0.0.1:{args.port}: {err}", file=sys.stderr)
        return 1
    print(f"Serving {name} at {server.url} (OpenAI-compatible). Ctrl-C stops.", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("Stopping.", file=sys.stderr)
    finally:
        server.server_close()
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
