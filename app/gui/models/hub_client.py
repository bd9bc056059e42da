"""The Hub calls the model picker makes in this (GUI) process: searching, and the token.

Gated models need a token: `store_token` keeps it in the system keyring (service "moe-chat",
user "huggingface") where a keyring backend exists, else in huggingface_hub's own token file;
`load_token` reads it back. `search_models` asks the Hub for models of supported architectures;
it blocks, so the picker runs it in a background thread. Both raise `HubError` for what can be
expected of a network (offline, refused, HTTP 401/403/429 …): its message is one sentence for
the user, its details go to the log file. No Qt here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app.download_child.hub_errors import HubError, check_reachable, explain, quiet_hub_logging
from app.settings.secrets import keyring_store
from app.settings.secrets import system_keyring as _keyring
from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.model.check import config_problems
from engine.model.derived_config import base_model_type

log = logging.getLogger(__name__)

KEYRING_SERVICE = "moe-chat"
KEYRING_USER = "huggingface"
# What a whole-repo download cannot load, by tag: a GGUF repo holds many quants (the catalog fetches
# one file), and formats the loader refuses. GPTQ/AWQ int4, FP8, MXFP4 and compressed-tensors' FP8
# and w4a16 load: config_problems judges those from the config, which says the method, scheme and
# bits ("4-bit" tags say neither).
QUANTIZED_TAGS = {"gguf", "bitsandbytes"}


# -- the token for gated models -------------------------------------------------------------------


def store_token(token: str) -> str:
    """Keep the Hugging Face token; returns where it went (for the user to read)."""
    token = token.strip()
    if not token:
        raise ValueError("The token is empty.")
    where = keyring_store(_keyring(), KEYRING_SERVICE, KEYRING_USER, token)
    if where is not None:
        return where
    log.warning("Using huggingface_hub's token file for the Hugging Face token")
    from huggingface_hub import login

    quiet_hub_logging()
    try:
        login(token=token, skip_if_logged_in=False)  # checks the token with the Hub, then saves it
    except Exception as err:
        raise HubError(explain(err)) from err
    return "huggingface_hub's token file"


def load_token() -> str | None:
    """The stored token: the keyring's, else huggingface_hub's (HF_TOKEN or its token file)."""
    backend = _keyring()
    if backend is not None:
        from keyring.errors import KeyringError

        try:
            token = backend.get_password(KEYRING_SERVICE, KEYRING_USER)
        except KeyringError as err:
            log.warning("Cannot read the keyring (%s)", err)
            token = None
        if token:
            return token
    from huggingface_hub import get_token

    return get_token()


# -- searching the Hub ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    architecture: str
    downloads: int
    gated: bool
    quantized: bool  # pre-quantized in a way MoE Chat cannot load (or GGUF: the catalog fetches one file)
    total_params: int | None = None


def search_models(query: str, limit: int = 20, endpoint: str | None = None) -> list[HubModel]:
    """Up to `limit` Hub models matching `query` whose architecture MoE Chat supports. Raises
    `HubError` (its message one sentence for the user) when the Hub cannot answer."""
    from huggingface_hub import HfApi

    quiet_hub_logging()
    check_reachable(endpoint)  # offline is said at once, not after huggingface_hub's retries
    try:
        return _search(HfApi(endpoint=endpoint, token=load_token() or None), query, limit)
    except HubError:
        raise
    except Exception as err:
        raise HubError(explain(err, endpoint=endpoint)) from err


def _search(api, query: str, limit: int) -> list[HubModel]:
    found: list[HubModel] = []
    listing = api.list_models(
        search=query.strip() or None,
        sort="downloads",
        limit=min(1000, max(100, limit * 10)),  # most matches are dense models, filtered out here
        expand=["config", "downloads", "gated", "safetensors", "tags"],
    )
    for info in listing:
        config = info.config or {}
        tags = set(info.tags or ())
        # a remote-code derivative is listed as the family it loads as (Kimi-K2: deepseek_v3)
        architecture = base_model_type(config) or next((t for t in tags if t in SUPPORTED_MODEL_TYPES), None)
        if architecture is None:
            continue
        found.append(
            HubModel(
                repo_id=info.id,
                architecture=architecture,
                downloads=info.downloads or 0,
                gated=bool(info.gated),
                quantized=bool(config_problems(config)) or bool(tags & QUANTIZED_TAGS),
                total_params=getattr(info.safetensors, "total", None),
            )
        )
        if len(found) >= limit:
            break
    return found
