"""The one prepared GPU check: `python -m engine.bench.gpu OUT_DIR [--budget-s 450]`.

A lent GPU machine is rare and short, so this runs everything a GPU must prove in one go, each
stage with its own time limit, and rewrites `OUT_DIR/gpu_check.json` after every stage (a stage
that fails or runs out of time is recorded with its error; the next one still runs):

    environment   torch, CUDA, the card, its memory, the driver, triton; pinned H2D GB/s, and a
                  kernel's GB/s reading pinned host memory where it lies (zero-copy)
    kernels       each ahead-of-time kernel (engine.gpu) loaded through the driver: its
                  correctness against torch's reference and its GB/s against the card's
                  memory bandwidth (skipped where the package has none yet)
    pytest        `pytest -m gpu`: the GPU tests' summary line and failures
    graphs        the whole decode step as one CUDA graph on the tiny model of every supported
                  family (`python -m engine.bench.graph_check`): greedy tokens and max |Δlogits|
                  against the eager step, captures, the body captured, why a capture failed
    shapes        the 16- and 48-layer Qwen3-30B-A3B-shaped Q4_K_M files (`ROWS`, the headline
                  rows first): every expert resident (the step as one CUDA graph, the fused expert
                  kernels), an 8 and a 4 GiB expert budget (the step in graph pieces), with and
                  without self-speculation, with the CPU computing misses where its measured
                  cost model says sooner, the step eager, the experts in torch — tok/s, TPOT
                  against the link floor, hit rate, hidden copy time, H2D GB/s, kernel launches
                  and host syncs a token (`python -m engine.bench --count-ops …`); written to the
                  JSON after each row

Nothing here is simulated: each figure is this card's. Stages run as child processes where
they load models, so a crash or an out-of-memory in one is that stage's error, not the end.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for gpu_check.json and the stages' logs")
    parser.add_argument("--budget-s", type=float, default=450.0, help="the whole check's time limit")
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 48], help="depths of the shape files")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": {}}
    deadline = time.monotonic() + args.budget_s
    stages_done = report["stages"]

    def partial_shapes(rows: dict) -> None:  # the shape rows so far, in case the run is cut short
        stages_done["shapes"] = {"partial": True, **rows}
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))

    def shape_rows(out: Path, limit: float) -> dict:
        h2d = stages_done.get("environment", {}).get("h2d_gbps")
        return shapes(out, limit, args.layers, h2d, partial_shapes)

    stages: list[tuple[str, float, Callable[[Path, float], dict]]] = [
        ("environment", 30, environment),
        ("kernels", 60, kernels),
        ("pytest", 150, lambda out, limit: gpu_tests(out, limit)),
        ("graphs", 90, graph_stage),
        ("shapes", 10_000, shape_rows),
    ]
    for name, limit, stage in stages:
        left = deadline - time.monotonic()
        if left < 5:
            report["stages"][name] = {"skipped": "the check's time budget ran out"}
        else:
            report["stages"][name] = _timed(stage, args.out, min(limit, left))
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
        print(f"{name}: {json.dumps(report['stages'][name])[:400]}", flush=True)
    return 0


def _timed(stage: Callable[[Path, float], dict], out: Path, limit: float) -> dict:
    start = time.monotonic()
    try:
        result = stage(out, limit)
    except Exception as err:  # a stage's failure is its result; the next stage still runs
        result = {"error": f"{type(err).__name__}: {err}"}
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def environment(out: Path, limit: float) -> dict:
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = None
    if not torch.cuda.is_available():
        return found | {"error": "no CUDA device"}
    props = torch.cuda.get_device_properties(0)
    found |= {
        "device": props.name,
        "capability": f"sm_{props.major}{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "h2d_gbps": _pinned_h2d_gbps(torch),
        "mapped_read_gbps": _mapped_read_gbps(torch),
    }
    driver = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=driver_version,pcie.link.gen.max,pcie.link.width.max",
            "--format=csv,noheader",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    found["nvidia_smi"] = driver.stdout.strip() or driver.stderr.strip()
    return found


def _pinned_h2d_gbps(torch) -> float:
    """Host-to-device copies of 256 MiB from pinned memory: the best of five, in GB/s."""
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    best = _best_seconds(torch, lambda: device.copy_(host, non_blocking=True))
    return round(host.numel() / best / 1e9, 2)


def _best_seconds(torch, work, repeats: int = 5) -> float:
    """The shortest of `repeats` runs of `work` on the current stream, timed by CUDA events."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _mapped_read_gbps(torch) -> float | None:
    """A kernel (a sum) reading 256 MiB of pinned host memory where it lies, through the device's
    view of it (zero-copy: what reading a missed expert without copying it would get): the best
    of five, in GB/s; None where pinned memory cannot be mapped."""
    from engine.device_cache.mapped_table import device_view

    host = torch.ones(64 << 20, dtype=torch.float32).pin_memory()
    view = device_view(host, torch.device("cuda"))
    if view is None:
        return None
    total = torch.empty((), device="cuda")
    best = _best_seconds(torch, lambda: torch.sum(view, out=total))
    if abs(total.item() - host.numel()) > 1e-3 * host.numel():  # it read other memory than the host's
        return None
    return round(host.numel() * 4 / best / 1e9, 2)


def kernels(out: Path, limit: float) -> dict:
    """The ahead-of-time kernels' own check (engine.gpu.checks), where the package has one."""
    try:
        from engine.gpu.checks import stage
    except ImportError as err:
        return {"skipped": f"no ahead-of-time kernel check here ({err})"}
    return stage.run(limit)


def gpu_tests(out: Path, limit: float) -> dict:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-x", "tests"]
    done = _child(command, out / "pytest.log", limit)
    lines = done["tail"].splitlines()
    done["summary"] = next((line for line in reversed(lines) if " passed" in line or " failed" in line), None)
    return done


def graph_stage(out: Path, limit: float) -> dict:
    """engine.bench.graph_check in a child: its JSON, or why there is none."""
    json_out = out / "graph_check.json"
    command = [sys.executable, "-m", "engine.bench.graph_check", str(json_out)]
    done = _child(command, out / "graph_check.log", limit)
    return json.loads(json_out.read_text()) | {"rc": done["rc"]} if json_out.exists() else done


def shapes(out: Path, limit: float, depths: list[int], h2d_gbps: float | None = None, on_row=None) -> dict:
    """Each depth's Q4_K_M file written (if missing) and benched in `ROWS`' order — the headline
    rows first (resident, then an 8 GiB budget), so that a run out of time still has them; each
    row's TPOT beside its link floor (bytes moved a token over `h2d_gbps`, the pinned copy rate);
    `on_row(rows so far)` after each row."""
    deadline, results = time.monotonic() + limit, {}
    paths: dict[int, Path | None] = {}
    for layers, variant, options in ROWS:
        if layers not in depths:
            continue
        if layers not in paths:
            paths[layers] = _shape_file(out, layers, deadline, results)
        if paths[layers] is not None:
            row = _bench(paths[layers], out, f"{layers}-{variant}", options, deadline - time.monotonic())
            results[f"{layers} layers, {variant}"] = row | _link_floor(row, h2d_gbps)
        if on_row is not None:
            on_row(results)
    return results


def _shape_file(out: Path, layers: int, deadline: float, results: dict) -> Path | None:
    """The `layers`-deep Q4_K_M shape file, written if missing (None where it could not be)."""
    folder = out / "shapes"
    path = folder / f"qwen3-30b-a3b-{layers}layers-Q4_K_M.gguf"
    if not path.exists():
        write = [sys.executable, "-m", "engine.bench.shapes", str(folder), "--types", "Q4_K_M", "--layers"]
        written = _child([*write, str(layers)], out / f"shapes-{layers}.log", deadline - time.monotonic())
        if written["rc"] != 0:
            results[f"{layers} layers"] = {"error": "the shape file was not written", **written}
            return None
    return path


def _link_floor(row: dict, h2d_gbps: float | None) -> dict:
    """The TPOT the link alone would take (the row's bytes a token at the pinned copy rate)."""
    moved = row.get("bytes_per_token")
    if not moved or not h2d_gbps:
        return {}
    floor_ms = 1e3 * moved / (h2d_gbps * 1e9)
    return {"link_floor_ms": round(floor_ms, 3), "tpot_over_floor": round(row["tpot_ms"] / floor_ms, 2)}


# the bench runs, in order: (depth, name, options); a budget's 8 and 4 GiB are the expert cache's
RESIDENT, EIGHT, FOUR = ["--expert-budget", "all"], ["--expert-budget", "8GiB"], ["--expert-budget", "4GiB"]
ROWS = (
    (16, "resident", RESIDENT),
    (48, "resident", RESIDENT),
    (48, "8 GiB", EIGHT),
    (48, "8 GiB, self-speculation", [*EIGHT, "--spec", "self"]),
    (48, "8 GiB, CPU misses", [*EIGHT, "--cpu-experts", "auto"]),
    (48, "8 GiB, self-speculation, no prefetch", [*EIGHT, "--spec", "self", "--prefetch", "none"]),
    (48, "resident, eager step", [*RESIDENT, "--step-graph", "off"]),
    (48, "8 GiB, eager step", [*EIGHT, "--step-graph", "off"]),
    (48, "4 GiB", FOUR),
    (48, "4 GiB, self-speculation", [*FOUR, "--spec", "self"]),
    (48, "4 GiB, CPU misses", [*FOUR, "--cpu-experts", "auto"]),
    (48, "resident, torch experts", [*RESIDENT, "--fused-experts", "off"]),
    (16, "8 GiB", EIGHT),
)


def _bench(path: Path, out: Path, tag: str, options: list[str], limit: float) -> dict:
    tag = tag.replace(" ", "-").replace(",", "")
    json_out = out / f"bench-{tag}.json"
    command = [sys.executable, "-m", "engine.bench", "--model", str(path), "--device", "cuda"]
    command += ["--prompts", "2", "--new-tokens", "32", "--repeats", "2"]
    command += ["--count-ops", "--json", str(json_out), *options]
    done = _child(command, out / f"bench-{tag}.log", limit)
    if json_out.exists():
        found = json.loads(json_out.read_text())
        row = found["rows"][-1]
        done |= {key: row.get(key) for key in BENCH_FIELDS} | {
            "op_counts": found.get("op_counts"),
            "step_graph": found.get("step_graph"),
            "step_pieces": found.get("step_pieces"),
        }
    return done


# what a shape row keeps of the bench's row
BENCH_FIELDS = (
    "tokens_per_s",
    "tpot_ms",
    "prefill_tokens_per_s",
    "step_path",
    "hit_rate",
    "h2d_gbps",
    "bytes_per_token",
    "copy_hidden",
)


def _child(command: list[str], log: Path, limit: float) -> dict:
    """`command` run with its output in `log`; its exit code and the output's tail."""
    if limit < 5:
        return {"rc": None, "tail": "", "error": "no time left"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as err:
        text = (
            (err.stdout or b"").decode(errors="replace")
            if isinstance(err.stdout, bytes)
            else err.stdout or ""
        )
        log.write_text(text)
        return {"rc": None, "tail": text[-2000:], "error": f"timed out after {limit:.0f} s"}
    log.write_text(done.stdout + done.stderr)
    return {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-2000:]}


if __name__ == "__main__":
    sys.exit(main())
