"""A local stand-in for the Hugging Face Hub, enough for `snapshot_download` and `list_models`.

`FakeHub` serves, on 127.0.0.1, the endpoints huggingface_hub 2.x calls:

- `GET /api/models/{repo}/revision/{rev}`: repo info (sha, siblings, gated);
- `GET /api/models/{repo}/tree/{rev}[/{path}]`: the file listing with sizes, git blob ids and,
  for `*.safetensors`, the LFS sha256 (what the Hub gives for large files);
- `HEAD|GET /{repo}/resolve/{rev}/{file}`: the bytes, with ETag, X-Repo-Commit, Content-Length,
  and `Range` requests answered with 206;
- `GET /api/models?search=…`: search results with config.model_type, downloads and gated.

Faults a test can switch on and off while the server runs: serve other bytes than the listing
says (`wrong_bytes`), close the connection part way through a file (`break_after`), send slowly
(`bytes_per_s`), ask for a token (`token` on a gated repo), answer every request with an HTTP
error as the Hub words it (`status`: 401, 403, 404, 429, 5xx), or close every connection without
an answer (`drop_connections`). Every request is logged in
`requests` as (method, path, headers) so a test can assert what was fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
CHUNK = 16 * 1024


def git_blob_id(data: bytes) -> str:
    """The git object id of a file's content (what the Hub lists as `oid`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    model_type: str = "qwen3_moe"
    downloads: int = 0
    gated: bool = False
    token: str | None = None  # the token a gated repo accepts
    config: dict = field(default_factory=dict)  # more of config.json for the model info
    tags: tuple[str, ...] = ()  # more of the Hub's tags (e.g. "compressed-tensors")

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)

    def tree_entry(self, name: str) -> dict:
        data = self.files[name]
        entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": name}
        if self.is_lfs(name):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def etag(self, name: str) -> str:
        entry = self.tree_entry(name)
        return entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]


@dataclass
class Faults:
    wrong_bytes: dict[str, bytes] = field(default_factory=dict)  # file → bytes served instead
    break_after: dict[str, int] = field(default_factory=dict)  # file → bytes sent before closing
    bytes_per_s: float | None = None  # throttle every file body
    status: int | None = None  # answer every request with this HTTP error
    drop_connections: bool = False  # close every connection before answering


# What the Hub sends with each error status (huggingface_hub reads X-Error-Code and X-Error-Message).
ERROR_HEADERS = {
    401: {"X-Error-Message": "Invalid credentials in Authorization header"},
    403: {"X-Error-Message": "Access to this resource is forbidden for this token"},
    404: {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
    429: {"X-Error-Message": "Too many requests", "Retry-After": "0"},
}


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.faults = Faults()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.bytes_sent: dict[str, int] = {}  # file name → body bytes sent, over all requests
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.repo_id] = repo
        return repo

    def log(self, method: str, path: str, headers: dict[str, str]) -> None:
        with self._lock:
            self.requests.append((method, path, headers))

    def count_sent(self, name: str, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent[name] = self.bytes_sent.get(name, 0) + nbytes

    def file_gets(self, repo_id: str) -> list[str]:
        """Paths of the files whose bytes were asked for (GET on resolve)."""
        prefix = f"/{repo_id}/resolve/"
        with self._lock:
            return [p for m, p, _ in self.requests if m == "GET" and p.startswith(prefix)]

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubHandler):
        pass

    Handler.hub = hub
    return Handler


class _HubHandler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # quiet: requests are in hub.requests
        pass

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_GET(self) -> None:
        self._route("GET")

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.hub.log(method, path, dict(self.headers.items()))
        faults = self.hub.faults
        if faults.drop_connections:
            self.close_connection = True
            self.connection.shutdown(2)  # the client sees the connection end with no answer
            return None
        if faults.status is not None:
            headers = ERROR_HEADERS.get(faults.status, {})
            return self._json({"error": headers.get("X-Error-Message", "error")}, faults.status, headers)
        query = parse_qs(url.query)
        if path == "/api/models":
            return self._search(query)
        if path.startswith("/api/models/"):
            return self._api(path.removeprefix("/api/models/"))
        if "/resolve/" in path:
            repo_id, rest = path.lstrip("/").split("/resolve/", 1)
            return self._resolve(method, repo_id, rest.split("/", 1)[1])
        return self._json({"error": "not found"}, 404)

    def _repo(self, repo_id: str) -> FakeRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
            return None
        if repo.gated and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self._json({"error": "Access to this model is restricted"}, 401, {"X-Error-Code": "GatedRepo"})
            return None
        return repo

    def _api(self, rest: str) -> None:
        for marker in ("/revision/", "/tree/"):
            if marker in rest:
                repo_id, tail = rest.split(marker, 1)
                break
        else:
            return self._json({"error": "not found"}, 404)
        repo = self._repo(repo_id)
        if repo is None:
            return None
        if marker == "/revision/":
            return self._json(_model_info(repo))
        prefix = tail.split("/", 1)[1] if "/" in tail else ""
        names = [n for n in sorted(repo.files) if n.startswith(prefix)]
        return self._json([repo.tree_entry(n) for n in names])

    def _search(self, query: dict[str, list[str]]) -> None:
        words = query.get("search", [""])[0].lower()
        found = [_model_info(r) for r in self.hub.repos.values() if words in r.repo_id.lower()]
        found.sort(key=lambda info: -info["downloads"])
        limit = int(query.get("limit", ["1000"])[0])
        self._json(found[:limit])

    def _resolve(self, method: str, repo_id: str, name: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return None
        if name not in repo.files:
            return self._json({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
        data = self.hub.faults.wrong_bytes.get(name, repo.files[name])
        start = _range_start(self.headers.get("Range"))
        headers = {
            "ETag": f'"{repo.etag(name)}"',
            "X-Repo-Commit": repo.sha,
            "Accept-Ranges": "bytes",
            "Content-Length": str(len(data) - start),
            "Content-Type": "application/octet-stream",
        }
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self.send_response(206 if start else 200)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if method == "GET":
            self._send_body(name, data, start)

    def _send_body(self, name: str, data: bytes, start: int) -> None:
        faults = self.hub.faults
        stop_at = faults.break_after.get(name)
        position = start
        while position < len(data):
            if stop_at is not None and position >= stop_at:
                self.close_connection = True
                self.wfile.flush()
                self.connection.shutdown(2)  # the peer sees the connection end before the body
                return
            chunk = data[position : position + CHUNK]
            try:
                self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):  # the client was killed or cancelled
                self.close_connection = True
                return
            position += len(chunk)
            self.hub.count_sent(name, len(chunk))
            if faults.bytes_per_s:
                time.sleep(len(chunk) / faults.bytes_per_s)

    def _json(self, payload, status: int = 200, extra: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def _range_start(header: str | None) -> int:
    if not header or not header.startswith("bytes="):
        return 0
    return int(header.removeprefix("bytes=").split("-", 1)[0] or 0)


def _model_info(repo: FakeRepo) -> dict:
    return {
        "_id": repo.repo_id,
        "id": repo.repo_id,
        "modelId": repo.repo_id,
        "sha": repo.sha,
        "private": False,
        "gated": "auto" if repo.gated else False,
        "downloads": repo.downloads,
        "likes": 0,
        "tags": ["safetensors", repo.model_type, "text-generation", *repo.tags],
        "config": {"model_type": repo.model_type, **repo.config},
        "siblings": [{"rfilename": n} for n in sorted(repo.files)],
    }
