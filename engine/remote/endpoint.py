"""A remote engine's address: `RemoteEndpoint(name, base_url, model)`, checked and normalized.

`base_url` is the OpenAI API root (`http://host:8000/v1`); an address with no path gets `/v1`
(what vLLM, SGLang, llama.cpp and MoE Chat serve), one with a path is kept as it is (a proxy's
`/api/v1`). `metrics_url` is the server's Prometheus `/metrics`, at the root beside `/v1`.
No secrets here: API keys live in the OS keyring (`app.settings.remotes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from engine.errors import InvalidConfigError


def normalize_base_url(url: str) -> str:
    """`url` as an OpenAI API root; raises `InvalidConfigError` for anything that is not http(s)."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidConfigError(
            f"{url!r} is not a server address: give one like http://host:8000 or https://host/v1."
        )
    if parts.username or parts.password:
        raise InvalidConfigError("Put the API key in the key field, not in the address.")
    if parts.query or parts.fragment:
        raise InvalidConfigError(f"{url!r}: a server address has no ?query or #fragment.")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number in range
    except ValueError as err:
        raise InvalidConfigError(f"{url!r}: {err}.") from err
    path = parts.path.rstrip("/") or "/v1"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


@dataclass(frozen=True)
class RemoteEndpoint:
    """A saved remote: a name for the user, the API root, and the model to use (None: the first listed)."""

    name: str
    base_url: str
    model: str | None = None

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise InvalidConfigError("A remote engine needs a name.")
        object.__setattr__(self, "name", self.name.strip())
        object.__setattr__(self, "base_url", normalize_base_url(self.base_url))
        if self.model is not None and not self.model.strip():
            object.__setattr__(self, "model", None)

    @property
    def metrics_url(self) -> str:
        """The Prometheus endpoint: `/metrics` at the server's root (vLLM, SGLang with --enable-metrics)."""
        parts = urlsplit(self.base_url)
        root = parts.path.removesuffix("/v1")
        return urlunsplit((parts.scheme, parts.netloc, root + "/metrics", "", ""))

    @classmethod
    def from_url(cls, url: str, model: str | None = None) -> RemoteEndpoint:
        """An unnamed endpoint (the CLI's --remote): named after its host."""
        base = normalize_base_url(url)
        return cls(urlsplit(base).netloc, base, model)
