"""What the terminal chat and the local server share: options, and starting an engine session.

`add_session_arguments` adds the engine's offload, sampling and speculation
options; `open_session` checks them (before the worker costs seconds to
start), starts the worker, and loads the model with a text progress bar on
stderr. Nothing here imports torch: the worker does.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Protocol, TextIO

from engine.errors import InvalidRequestError
from engine.generation_config import GenerationConfig
from engine.options import (
    add_offload_arguments,
    add_sampling_arguments,
    add_sim_link_argument,
    add_spec_arguments,
    generation_config,
    offload_config,
    wants_calibrated_link,
)
from engine.worker.client import EngineSession
from engine.worker.protocol import Loaded, LoadProgress

log = logging.getLogger(__name__)

DEMO_MODEL_ID = "moe-chat-demo"
SERVED_MAX_TOKENS = 512  # a server request's reply length when it names none (the CLI's and the window's)
BAR_WIDTH = 30


def add_session_arguments(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """--model, the offload, sampling and speculation options, and --verbose."""
    add_offload_arguments(parser)
    add_sim_link_argument(parser)
    add_sampling_arguments(parser, max_new_tokens=max_new_tokens)
    add_spec_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")


def model_id(model_dir: str | None) -> str:
    """A stable name for the model: the demo's, a Hugging Face cache entry's repo id, or the folder name."""
    if not model_dir:
        return DEMO_MODEL_ID
    folder = Path(model_dir).expanduser().resolve()
    # ~/.cache/huggingface/hub/models--Org--Name/snapshots/<commit>: the repo id says more than a hash
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.removeprefix("models--").replace("--", "/")
    return folder.name


class LoadProgressView(Protocol):
    """Shows `LoadProgress` events; `close` ends the display."""

    def __call__(self, progress: LoadProgress) -> None: ...
    def close(self) -> None: ...


class ProgressBar:
    """`stage [#####.....] done/total` on one line of a terminal, redrawn in place.

    Into a file or a pipe it writes each stage's bar once, when the stage is done."""

    def __init__(self, stream: TextIO = sys.stderr):
        self.stream = stream
        self.redraw = stream.isatty()
        self._stage: str | None = None

    def __call__(self, progress: LoadProgress) -> None:
        if not self.redraw and progress.done < progress.total:
            return
        if self._stage is not None and progress.stage != self._stage:
            self.stream.write("\n")  # keep the finished stage's bar on its own line
        self._stage = progress.stage
        filled = BAR_WIDTH * progress.done // progress.total if progress.total else BAR_WIDTH
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        self.stream.write(f"\r{progress.stage:<8} [{bar}] {progress.done}/{progress.total}")
        self.stream.flush()

    def close(self) -> None:
        if self._stage is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._stage = None


def open_session(
    args: argparse.Namespace, stream: TextIO = sys.stderr, progress: LoadProgressView | None = None
) -> tuple[EngineSession, Loaded, GenerationConfig]:
    """Start the worker and load `--model`, showing the load on `progress` (a text bar on
    `stream` by default); the session is closed again when this fails.

    Raises `EngineError` (a bad option, a model that does not load, a worker that dies)."""
    if wants_calibrated_link(args):
        raise InvalidRequestError(
            "--sim-link calibrated is measured by `python -m engine` and `python -m engine.bench`; "
            "here give the link's bandwidth in GB/s (e.g. --sim-link 16)."
        )
    offload = offload_config(args)
    offload.validate()
    config = generation_config(args)
    config.validate()
    session = EngineSession()
    bar = progress if progress is not None else ProgressBar(stream)
    try:
        started = time.perf_counter()
        stream.write("Starting the engine…\n")
        stream.flush()
        ready = session.start()
        log.info("Worker %d ready on %s (%s)", ready.pid, ready.device.name, ready.device.kind)
        loaded = session.load(args.model, offload, on_progress=bar)
        bar.close()
        took = time.perf_counter() - started
        stream.write(f"Loaded {describe_model(model_id(args.model), loaded)} in {took:.1f} s.\n")
        stream.flush()
    except BaseException:  # KeyboardInterrupt too: never leave a worker behind
        bar.close()
        session.close()
        raise
    return session, loaded, config


def describe_model(name: str, loaded: Loaded) -> str:
    """One line: the model's name, architecture, experts and where its cache is."""
    model = loaded.model
    link = ", simulated link" if model.get("simulated_link") else ""
    return (
        f"{name} ({model.get('model_type')}, {model.get('num_experts')} experts "
        f"× {model.get('moe_layers')} MoE layers, {model.get('cache_slots')} cache slots on "
        f"{model.get('device')}{link})"
    )


def report_start_failure(err: BaseException, stream: TextIO = sys.stderr) -> int:
    """Say why `open_session` failed; the exit status for it: 2 for a bad option, 130 for Ctrl-C, else 1."""
    if isinstance(err, KeyboardInterrupt):
        stream.write("interrupted\n")
        return 130
    stream.write(f"error: {err}\n")
    return 2 if isinstance(err, InvalidRequestError) else 1
