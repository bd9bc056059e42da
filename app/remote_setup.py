"""The terminal chat on a remote engine: `moe-chat-cli --remote URL|NAME [--api-key-env VAR] [--model ID]`.

`--remote` is a server address (`http://gpu-box:8000`) or the name of a remote saved in the app
(`app.settings.remotes`, with its default model). The API key comes from the environment variable
`--api-key-env` names, else from the OS keyring where the app saved one for that address, else
none. `--model` picks the remote's model id (default: the saved one, else the first the server
lists). Sampling options apply; the local engine's options (offload, speculation) do not.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

from app.settings.remotes import RemoteStore
from engine.errors import InvalidRequestError
from engine.generation_config import GenerationConfig
from engine.options import generation_config
from engine.remote.endpoint import RemoteEndpoint


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--remote",
        default=None,
        metavar="URL|NAME",
        help="chat with a remote OpenAI-compatible engine (vLLM, SGLang, llama.cpp, another MoE Chat): "
        "its address or the name of a remote saved in the app; --model then names the remote's model",
    )
    parser.add_argument(
        "--api-key-env",
        default=None,
        metavar="VAR",
        help="read the remote's API key from this environment variable (default: the key the app "
        "keeps in the system keyring for that address, if any)",
    )


def remote_endpoint(args: argparse.Namespace, store: RemoteStore) -> RemoteEndpoint:
    """The endpoint `--remote` means: a saved remote of that name, else an address."""
    saved = {r.name: r for r in store.remotes()}
    endpoint = saved.get(args.remote) or RemoteEndpoint.from_url(args.remote)
    return RemoteEndpoint(endpoint.name, endpoint.base_url, args.model or endpoint.model)


def api_key(args: argparse.Namespace, endpoint: RemoteEndpoint, store: RemoteStore) -> str | None:
    if args.api_key_env:
        key = os.environ.get(args.api_key_env, "").strip()
        if not key:
            raise InvalidRequestError(
                f"--api-key-env {args.api_key_env}: that environment variable is not set."
            )
        return key
    return store.key(endpoint)


def open_remote_session(
    args: argparse.Namespace, stream: TextIO = sys.stderr, store: RemoteStore | None = None
):
    """Connect to `--remote` and choose its model: (RemoteSession, GenerationConfig).

    Raises `EngineError` (a bad address or option, a server that cannot be reached or refuses)."""
    from engine.remote.session import connect  # the openai client loads only for a remote chat

    store = store or RemoteStore()
    config: GenerationConfig = generation_config(args)
    config.validate()
    endpoint = remote_endpoint(args, store)
    stream.write(f"Connecting to {endpoint.base_url}…\n")
    stream.flush()
    session = connect(endpoint, api_key(args, endpoint, store), endpoint.model)
    served = session.model.get("models") or []
    stream.write(
        f"Connected: {session.model['model_id']} on {endpoint.base_url} ({len(served)} model(s) served).\n"
    )
    stream.flush()
    return session, config
