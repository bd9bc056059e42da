"""llama.cpp on the very same GGUF file, timed the way the engine reports it (`--vs-llama-cpp`).

Needs the optional extra `llama` (`pip install -e ".[llama]"`: llama-cpp-python, which
builds llama.cpp from source, about 10–20 minutes on 2 cores). Both engines get the same
prompt token ids, greedy decoding, the same number of new tokens and the same number of
CPU threads; time to the first token is prefill, the rest is decode, as in
`GenerationStats` (tpot_ms = decode wall time / decoded tokens).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from engine.bench.rows import BenchRow
from engine.errors import EngineError


class LlamaCppUnavailable(EngineError):
    kind = "llama_cpp_unavailable"


class LlamaCppRunner:
    """One llama.cpp model (llama-cpp-python), all weights in host memory."""

    def __init__(self, path: str | Path, threads: int, n_ctx: int = 2048):
        try:
            from llama_cpp import Llama
        except ImportError as err:
            raise LlamaCppUnavailable(
                "--vs-llama-cpp needs llama-cpp-python: pip install -e '.[llama]' (it builds llama.cpp, "
                "10-20 minutes)."
            ) from err
        self.threads = threads
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False)

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
        """One pass over the prompts: what `engine.bench.main.engine_pass` measures."""
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


def compare_llama_cpp(args, prompt_ids: list[list[int]], ours: BenchRow, result: dict) -> BenchRow:
    """llama.cpp on the same file and prompts, timed over as many passes; the ratios go in `result`."""
    import torch

    n_ctx = max(2048, max(map(len, prompt_ids)) + args.new_tokens + 8)
    runner = LlamaCppRunner(args.vs_llama_cpp, threads=torch.get_num_threads(), n_ctx=n_ctx)
    try:
        runner.timed_pass([prompt_ids[0][:8]], 4)  # warm-up
        passes = [runner.timed_pass(prompt_ids, args.new_tokens) for _ in range(args.repeats)]
    finally:
        runner.close()
    median = median_pass(passes)
    theirs = BenchRow(
        engine="llama.cpp",
        budget="all in RAM",
        cache_slots=None,
        tpot_ms=median["tpot_ms"],
        tokens_per_s=1e3 / median["tpot_ms"],
        prefill_tokens_per_s=median["prefill_tps"],
        hit_rate=None,
        h2d_gbps=None,
        bytes_per_token=None,
        decode_tokens=median["decode_tokens"],
        simulated_link=False,
    )
    result["llama_cpp"] = {
        "file": str(args.vs_llama_cpp),
        "threads": runner.threads,
        "decode_ratio": ours.tokens_per_s / theirs.tokens_per_s,
        "prefill_ratio": (ours.prefill_tokens_per_s or 0) / theirs.prefill_tokens_per_s,
        "their_spread": spread(passes),
    }
    return theirs
