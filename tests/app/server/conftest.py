"""A real server over a real worker with the demo model, shared by a test module (a worker
costs seconds to start), and raw-HTTP helpers for what the `openai` client hides."""

import http.client
import json

import openai
import pytest
from transformers import AutoTokenizer

from app.server.openai_api import ChatBackend
from app.server.openai_server import ApiServer
from app.session_setup import DEMO_MODEL_ID
from engine.config import OffloadConfig
from engine.generation_config import GenerationConfig
from engine.resources import demo_model_dir
from engine.worker.client import EngineSession

COW = [{"role": "user", "content": "What sound does a cow make?"}]


class LiveServer:
    """One server, its backend and its session; `stop()` undoes all three."""

    def __init__(
        self,
        api_key: str | None = None,
        max_new_tokens: int = 64,
        model_dir: str | None = None,
        defaults: GenerationConfig | None = None,
    ):
        """Over the demo model, or the model in `model_dir` (served as DEMO_MODEL_ID all the same)."""
        self._clients: list[openai.OpenAI] = []
        self.session = EngineSession()
        self.session.start()
        try:
            self.session.load(model_dir, offload=OffloadConfig(device="cpu"))
            defaults = defaults or GenerationConfig(max_new_tokens=max_new_tokens)
            self.backend = ChatBackend(self.session, DEMO_MODEL_ID, defaults)
            self.server = ApiServer(self.backend, port=0, api_key=api_key).start()
        except BaseException:
            self.session.close()
            raise

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, timeout: float = 60, api_key: str = "unused") -> openai.OpenAI:
        """An `openai` client of this server, closed with it (an unclosed one's sockets warn at GC)."""
        client = openai.OpenAI(base_url=self.url, api_key=api_key, max_retries=0, timeout=timeout)
        self._clients.append(client)
        return client

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict | None = None
    ) -> tuple[int, dict | str]:
        """A raw request; the JSON body, or the text when it is not JSON."""
        host, port = self.server.address
        conn = http.client.HTTPConnection(host, port, timeout=30)
        try:
            conn.request(
                method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})}
            )
            response = conn.getresponse()
            data = response.read()
            try:
                return response.status, json.loads(data)
            except ValueError:
                return response.status, data.decode("utf-8", "replace")
        finally:
            conn.close()

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        self.server.stop()
        self.backend.close()
        self.session.close()


def host(server: ApiServer) -> str:
    """The server's root URL (no /v1): where Ollama's clients point."""
    address, port = server.address
    return f"http://{address}:{port}"


@pytest.fixture(scope="module")
def live():
    server = LiveServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def live_client(live) -> openai.OpenAI:
    """An `openai` client of the module's `live` server."""
    return live.client()


@pytest.fixture(scope="module")
def tokenizer():
    """The demo model's tokenizer."""
    return AutoTokenizer.from_pretrained(demo_model_dir())


def assert_openai_error(body: dict) -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]
