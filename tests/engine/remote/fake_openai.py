"""A tiny raw-socket HTTP server on 127.0.0.1 for the faults no real server makes on demand: each
chat request gets the next scripted answer (bytes written as they are, then the socket closed),
so a test can cut a stream mid-reply, answer 429/500/400, or say nothing at all."""

from __future__ import annotations

import json
import socket
import socketserver
import threading

MODELS = json.dumps({"object": "list", "data": [{"id": "fake-moe", "object": "model", "owned_by": "test"}]})


def http(status: str, body: str, headers: dict[str, str] | None = None) -> bytes:
    head = {"Content-Type": "application/json", "Content-Length": str(len(body.encode())), **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    return f"HTTP/1.1 {status}\r\n{lines}Connection: close\r\n\r\n{body}".encode()


def sse_chunk(content: str | None = None, finish: str | None = None) -> str:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    payload = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake-moe",
        "choices": [choice],
    }
    return f"data: {json.dumps(payload)}\n\n"


def chunked(*pieces: str, end: bool = True) -> bytes:
    """A streamed 200 answer of `pieces`; `end=False` stops before the final chunk (a cut stream)."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b"".join(f"{len(p.encode()):x}\r\n".encode() + p.encode() + b"\r\n" for p in pieces)
    return head + body + (b"0\r\n\r\n" if end else b"")


def full_reply(*words: str) -> bytes:
    return chunked(*(sse_chunk(w) for w in words), sse_chunk(finish="stop"), "data: [DONE]\n\n")


SILENCE = b""  # answer nothing: the client's read timeout must end the wait


class FakeOpenAI:
    """`answers`: bytes for each chat request in turn (the last one repeats); with `api_key`, a
    request without `Authorization: Bearer <api_key>` gets a 401."""

    def __init__(self, *answers: bytes, api_key: str | None = None):
        self.answers, self.api_key = list(answers), api_key
        self.requests: list[dict] = []
        fake = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                fake._handle(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._release = threading.Event()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def _handle(self, sock: socket.socket) -> None:
        data = sock.recv(65536)
        if data[:1] == b"\x16":  # a TLS handshake: answer in plain HTTP, as a server without TLS does
            sock.sendall(http("400 Bad Request", "{}"))
            return
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        while len(body) < length:
            body += sock.recv(65536)
        path = head.split(b" ")[1].decode()
        if self.api_key is not None and f"authorization: bearer {self.api_key}".encode() not in head.lower():
            sock.sendall(http("401 Unauthorized", '{"error": {"message": "Invalid API key"}}'))
            return
        if path.endswith("/models"):
            sock.sendall(http("200 OK", MODELS))
            return
        if path.endswith("/metrics"):
            sock.sendall(http("404 Not Found", '{"detail": "Not Found"}'))
            return
        self.requests.append(json.loads(body))
        answer = self.answers[0] if len(self.answers) == 1 else self.answers.pop(0)
        if answer is SILENCE:
            self._release.wait(30)  # until the test ends: the client gives up first
            return
        sock.sendall(answer)

    def stop(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()
