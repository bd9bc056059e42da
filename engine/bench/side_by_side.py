"""Other engines and models beside the bench's own: `--and-model DIR`, the same bench on a second
model (the same weights in another format, say a GGUF and its BF16 safetensors), run in a child
process so each model's peak RSS is its own, and printed beside the first: link bytes per token,
memory, and decode speed as ratios; `--compare-transformers`, transformers' own `generate` timed
in passes alternated with the engine's (`compare_side_by_side`)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine.bench.passes import engine_pass, engine_row
from engine.bench.rows import BenchRow
from engine.config import OffloadConfig
from engine.errors import EngineError
from engine.options import model_folder

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


class TransformersRunner:
    """transformers' own generate with every expert resident, timed the way the engine reports:
    decode time = time for N tokens - time for 1 token."""

    def __init__(self, folder: Path, device, dtype):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.device = torch, device
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()

    def _timed(self, ids: list[int], n: int) -> float:
        inputs = self.torch.tensor([ids], device=self.device)
        start = time.perf_counter()
        with self.torch.no_grad():
            self.model.generate(
                inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None
            )
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
        return time.perf_counter() - start

    def tpot_ms(self, prompt_ids: list[list[int]], new_tokens: int) -> float:
        decode_s = 0.0
        for ids in prompt_ids:
            whole = self._timed(ids, new_tokens)
            # Under heavy CPU contention one token can take longer than N: fall back to N tokens' mean.
            decode_s += max(whole - self._timed(ids, 1), whole * (new_tokens - 1) / new_tokens)
        return decode_s * 1e3 / (len(prompt_ids) * (new_tokens - 1))

    def row(self, tpots: list[float], decode_tokens: int) -> BenchRow:
        tpot = statistics.median(tpots)
        return BenchRow(
            engine="transformers",
            budget="all (resident)",
            cache_slots=None,
            tpot_ms=tpot,
            tokens_per_s=1e3 / tpot,
            prefill_tokens_per_s=None,
            hit_rate=None,
            h2d_gbps=None,
            bytes_per_token=None,
            decode_tokens=decode_tokens,
            simulated_link=False,
        )


def compare_side_by_side(args, budget: str, prompt_ids, config: OffloadConfig) -> tuple[BenchRow, BenchRow]:
    """The engine and transformers timed in alternating passes, so drifts of the machine hit both."""
    from engine.loader import load_model

    model = load_model(model_folder(args), config)
    try:
        reference = TransformersRunner(Path(model_folder(args)), model.device, model.dtype)
        engine_pass(model, [prompt_ids[0][:8]], 4)
        reference.tpot_ms([prompt_ids[0][:8]], 4)  # warm-ups
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(engine_pass(model, prompt_ids, args.new_tokens))
            theirs.append(reference.tpot_ms(prompt_ids, args.new_tokens))
        row = engine_row(model, ours)
        return row, reference.row(theirs, row.decode_tokens)
    finally:
        model.close()
