"""llama.cpp on the very same GGUF file, timed the way the engine reports it (`--vs-llama-cpp`).

Needs the optional extra `llama` (`pip install -e ".[llama]"`: llama-cpp-python, which
builds llama.cpp from source, which takes minutes). Both engines get the same
prompt token ids, greedy decoding, the same number of new tokens and the same number of
CPU threads; time to the first token is prefill, the rest is decode, as in
`GenerationStats` (tpot_ms = decode wall time / decoded tokens). Where the host's memory holds
both engines' weights, their passes alternate (`side_by_side`), so a drift of the machine (a
virtual machine's memory bandwidth can move between minutes) hits both alike; else
llama.cpp's passes follow MoE Chat's, once its model is closed (`compare_llama_cpp`).
"""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

from engine.bench import passes
from engine.bench.memory import peak_rss_bytes
from engine.bench.rows import BenchRow
from engine.errors import EngineError


class LlamaCppUnavailable(EngineError):
    kind = "llama_cpp_unavailable"


_INSTALL = (
    "--vs-llama-cpp needs llama-cpp-python: pip install -e '.[llama]' (it builds llama.cpp, 10-20 minutes)."
)


# a child process's llama.cpp: the file loaded, two tokens generated (a crash kills the child only)
_PROBE = (
    "import sys; from llama_cpp import Llama; "
    "n = int(sys.argv[2]); llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=n, n_threads_batch=n, "
    "verbose=False); "
    "[t for _, t in zip(range(2), llm.generate([1, 2, 3], top_k=1, temp=0.0))]"
)
PROBE_TIMEOUT_S = 600  # a large file's first read from disk


def check_available(path: str | Path | None = None) -> None:
    """Raise `LlamaCppUnavailable` where llama-cpp-python is missing (saying how to install it),
    or where its llama.cpp crashes or hangs on the file `path` (run in a child process first: a
    crash in-process would take the whole bench down with a bare segmentation fault)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        raise LlamaCppUnavailable(_INSTALL) from err
    if path is None:
        return
    command = [sys.executable, "-c", _PROBE, str(path), str(_threads())]
    try:
        probe = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise LlamaCppUnavailable(
            f"llama.cpp did not generate 2 tokens of {path} within {PROBE_TIMEOUT_S} s."
        ) from err
    if probe.returncode != 0:
        raise LlamaCppUnavailable(_probe_failure(path, probe.returncode, probe.stderr))


def _probe_failure(path: str | Path, returncode: int, stderr: str) -> str:
    if returncode < 0:
        what = f"llama.cpp crashed ({signal.Signals(-returncode).name}) on {path} on this machine."
    else:
        last = stderr.strip().splitlines()[-1:] or ["no message"]
        what = f"llama.cpp failed on {path}: {last[0]}"
    if _cpu_has_amx():
        what += (
            " This CPU has AMX, whose llama.cpp kernels crash on some hosts (seen in a VM): rebuild "
            "llama-cpp-python without them, e.g. CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON "
            "-DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF' "
            "pip install --force-reinstall --no-deps llama-cpp-python."
        )
    return what


def _cpu_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return False


def fits_beside(path: str | Path) -> bool:
    """Whether the memory left holds llama.cpp's copy of the file's weights with room to spare."""
    return psutil.virtual_memory().available >= Path(path).stat().st_size * 1.25 + 2**30


class LlamaCppRunner:
    """One llama.cpp model (llama-cpp-python), all weights in host memory."""

    def __init__(self, path: str | Path, threads: int, n_ctx: int = 2048):
        try:
            from llama_cpp import Llama
        except ImportError as err:
            raise LlamaCppUnavailable(_INSTALL) from err
        self.path, self.threads = Path(path), threads
        # prompts too on `threads` (llama-cpp-python's batch threads default to every CPU)
        threaded = {"n_threads": threads, "n_threads_batch": threads}
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, verbose=False, **threaded)

    def close(self) -> None:
        self.llm.close()

    def run(self, prompt_ids: list[int], new_tokens: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of one greedy generation of `new_tokens` tokens."""
        self.llm.reset()
        started = time.perf_counter()
        first = None
        for produced, _ in enumerate(self.llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True), 1):
            if first is None:
                first = time.perf_counter()
            if produced >= new_tokens:
                break
        return first - started, time.perf_counter() - first

    def timed_pass(self, prompts: list[list[int]], new_tokens: int) -> dict:
        """One pass over the prompts: what `engine.bench.passes.engine_pass` measures."""
        runs = [self.run(ids, new_tokens) for ids in prompts]
        decode_tokens = len(prompts) * (new_tokens - 1)
        return {
            "tpot_ms": sum(d for _, d in runs) * 1e3 / decode_tokens,
            "prefill_tps": sum(len(ids) for ids in prompts) / sum(p for p, _ in runs),
            "decode_tokens": decode_tokens,
        }


def median_pass(passes: list[dict]) -> dict:
    """The pass with the median tpot (as the engine's rows take)."""
    return sorted(passes, key=lambda p: p["tpot_ms"])[len(passes) // 2]


def spread(passes: list[dict]) -> float:
    """Relative spread of the passes' tpot (max − min over the median), to judge the ratio by."""
    tpots = [p["tpot_ms"] for p in passes]
    return (max(tpots) - min(tpots)) / statistics.median(tpots)


def _threads() -> int:
    """llama.cpp's threads: torch's, which MoE Chat computes with."""
    import torch

    return torch.get_num_threads()


def _runner(args, prompt_ids: list[list[int]]) -> LlamaCppRunner:
    n_ctx = max(2048, max(map(len, prompt_ids)) + args.new_tokens + 8)
    runner = LlamaCppRunner(args.vs_llama_cpp, threads=_threads(), n_ctx=n_ctx)
    runner.timed_pass([prompt_ids[0][:8]], 4)  # warm-up
    return runner


def compare_llama_cpp(args, prompt_ids: list[list[int]], ours: BenchRow, result: dict) -> BenchRow:
    """llama.cpp on the same file and prompts after MoE Chat's passes, as many; the ratios go in
    `result`."""
    runner = _runner(args, prompt_ids)
    try:
        passes = [runner.timed_pass(prompt_ids, args.new_tokens) for _ in range(args.repeats)]
    finally:
        runner.close()
    theirs, result["llama_cpp"] = _compared(ours, passes, runner, False)
    return theirs


def side_by_side(
    args, model, prompt_ids: list[list[int]], baseline_rss: int
) -> tuple[BenchRow, BenchRow, dict]:
    """MoE Chat's `model` and llama.cpp on the same file and prompts, their passes alternated:
    (MoE Chat's row, llama.cpp's, the ratios). MoE Chat's memory figures are taken before
    llama.cpp's weights join the process."""
    decoding = passes.decoding_of(args)

    def engine_pass(prompts: list[list[int]], new_tokens: int) -> dict:
        return passes.engine_pass(model, prompts, new_tokens, decoding)

    engine_pass([prompt_ids[0][:8]], 4)  # warm-up
    ours = [engine_pass(prompt_ids, args.new_tokens)]
    peak = peak_rss_bytes()
    runner = _runner(args, prompt_ids)
    try:
        theirs = [runner.timed_pass(prompt_ids, args.new_tokens)]
        for _ in range(args.repeats - 1):
            ours.append(engine_pass(prompt_ids, args.new_tokens))
            theirs.append(runner.timed_pass(prompt_ids, args.new_tokens))
    finally:
        runner.close()
    row = passes.engine_row(model, ours, baseline_rss, max(map(len, prompt_ids)) + args.new_tokens, peak)
    theirs_row, ratios = _compared(row, theirs, runner, True)
    return row, theirs_row, ratios | paired_ratios(ours, theirs)


def paired_ratios(ours: list[dict], theirs: list[dict]) -> dict:
    """The median over alternated pass pairs of each pair's decode and prefill ratio: a drift of
    the host between pairs (its memory bandwidth may move between minutes) cancels."""
    pairs = list(zip(ours, theirs, strict=True))
    return {
        "paired_decode_ratio": statistics.median(t["tpot_ms"] / o["tpot_ms"] for o, t in pairs),
        "paired_prefill_ratio": statistics.median(o["prefill_tps"] / t["prefill_tps"] for o, t in pairs),
        "pairs": len(pairs),
    }


def _compared(
    ours: BenchRow, passes: list[dict], runner: LlamaCppRunner, alternated: bool
) -> tuple[BenchRow, dict]:
    """llama.cpp's row from its passes (the median tpot's; the passes' median prefill rate, as
    MoE Chat's row takes it), and the ratios."""
    median = median_pass(passes)
    theirs = BenchRow(
        engine="llama.cpp",
        budget="all in RAM",
        cache_slots=None,
        tpot_ms=median["tpot_ms"],
        tokens_per_s=1e3 / median["tpot_ms"],
        prefill_tokens_per_s=statistics.median(p["prefill_tps"] for p in passes),
        hit_rate=None,
        h2d_gbps=None,
        bytes_per_token=None,
        decode_tokens=median["decode_tokens"],
        simulated_link=False,
    )
    return theirs, {
        "file": str(runner.path),
        "threads": runner.threads,
        "decode_ratio": ours.tokens_per_s / theirs.tokens_per_s,
        "prefill_ratio": (ours.prefill_tokens_per_s or 0) / theirs.prefill_tokens_per_s,
        "their_spread": spread(passes),
        "alternated": alternated,
    }
