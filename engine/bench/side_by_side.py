"""`--and-model DIR`: the same bench on a second model (the same weights in another format, say a
GGUF and its BF16 safetensors), run in a child process so each model's peak RSS is its own, and
printed beside the first: link bytes per token, memory, and decode speed as ratios."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.errors import EngineError

CHILD_TIMEOUT_S = 3600  # one model's whole bench; a hung child is killed, never waited on forever
_ALONE = {"--and-model": 1, "--vs-llama-cpp": 1, "--json": 1, "--model": 1}


class SideBySideFailed(EngineError):
    kind = "bench_failed"


def child_arguments(argv: list[str], model: str, json_out: Path) -> list[str]:
    """`argv` for the second model: the same options, its --model, no --and-model/--vs-llama-cpp."""
    kept, skip = [], 0
    for arg in argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip -= 1
        elif name in _ALONE:
            skip = _ALONE[name] if "=" not in arg else 0
        else:
            kept.append(arg)
    return [*kept, "--model", model, "--json", str(json_out)]


def bench_other(argv: list[str], model: str) -> dict:
    """Run `python -m engine.bench` on `model` with the options of `argv`; its JSON result."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, "-m", "engine.bench", *child_arguments(argv, model, out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as err:
            raise SideBySideFailed(f"The bench of {model} took over {CHILD_TIMEOUT_S} s; stopped.") from err
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SideBySideFailed(f"The bench of {model} failed: {tail[0]}")
        return json.loads(out.read_text())


def ratios(ours: dict, theirs: dict) -> dict:
    """This model's figures over the other's (first budget's rows)."""

    def ratio(key: str) -> float | None:
        mine, other = ours.get(key), theirs.get(key)
        return mine / other if mine is not None and other else None

    return {
        "bytes_per_token": ratio("bytes_per_token"),
        "store_bytes": ratio("store_bytes"),
        "peak_rss_bytes": ratio("peak_rss_bytes"),
        "tokens_per_s": ratio("tokens_per_s"),
    }


def ratio_line(label: str, other: str, found: dict) -> str:
    parts = [f"{name.replace('_', ' ')} {value:.3f}x" for name, value in found.items() if value is not None]
    return f"{label} over {other}: " + ", ".join(parts)
