"""One pass of the bench's fixed prompts through the engine, and the row its passes make.

`engine_pass(model, prompt_ids, new_tokens, decoding)` generates greedily from each prompt
(prefilled whole) and gives the pass's figures — plainly, or speculating, prefetching and
computing misses on the CPU as `decoding` (`decoding_of(args)`: the bench's options) says;
`engine_row` the `BenchRow` of the pass with the median tpot (the prefill rate: the passes'
median, a pass's prefill being a few dozen milliseconds that a burst of the host's noise can
halve), with the memory figures; `bench_engine` a warm-up and `repeats` passes.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace

from engine import huge_pages
from engine.bench.memory import kv_cache_bytes, peak_rss_bytes
from engine.bench.rows import BenchRow
from engine.generation_config import GenerationConfig
from engine.prompts import greedy


def decoding_of(args) -> GenerationConfig:
    """The decoding the bench's options ask for: speculation, prefetch, the cutoff, CPU misses."""
    from engine.options import spec_config

    asked = {"prefetch": args.prefetch, "cutoff": args.cutoff, "cpu_experts": args.cpu_experts}
    return replace(greedy(0), spec=spec_config(args), **asked)


def engine_pass(
    model, prompt_ids: list[list[int]], new_tokens: int, decoding: GenerationConfig | None = None
) -> dict:
    """One pass of greedy, fixed-length generations over the prompt set, decoded as `decoding`
    says (None: plainly)."""
    from engine.device_cache.transfer import metered
    from engine.generation import generate_text

    request = greedy(new_tokens) if decoding is None else replace(decoding, max_new_tokens=new_tokens)
    runs = []
    with metered(model.transfer) as meter:
        for ids in prompt_ids:
            # every prompt prefilled whole, as llama.cpp's timed runs are (reset()): a kept cache of
            # an earlier pass would make prefill a prefix reuse (engine.model.prefix_cache)
            model.prefix_cache.clear()
            runs.append(generate_text(model, ids, request).stats)
    decode_tokens = sum(s.generated_tokens - 1 for s in runs)
    decode_s = sum(s.decode_ms for s in runs) / 1e3
    prefill_s = sum(s.prefill_ms for s in runs) / 1e3
    hits, misses = sum(s.decode.hits for s in runs), sum(s.decode.misses for s in runs)
    paths = Counter()
    for s in runs:
        paths.update(s.step_paths)
    return {
        "tpot_ms": decode_s * 1e3 / decode_tokens,
        "prefill_tps": sum(s.prompt_tokens for s in runs) / prefill_s,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "h2d_gbps": sum(s.h2d_bytes for s in runs) / (decode_s + prefill_s) / 1e9,
        "bytes_per_token": sum(s.decode.h2d_bytes for s in runs) / decode_tokens,
        "decode_tokens": decode_tokens,
        "copy_hidden": meter.hidden,
        "step_paths": dict(paths),
        "step_path_declined": {k: v for s in runs for k, v in s.step_path_declined.items()},
    }


def engine_row(
    model, passes: list[dict], baseline_rss: int | None = None, tokens: int = 0, peak_rss: int | None = None
) -> BenchRow:
    """The pass with the median tpot; `tokens`: the longest sequence run (for the KV cache);
    `peak_rss`: the process's peak when taken earlier (before another engine's weights joined it)."""
    median = sorted(passes, key=lambda p: p["tpot_ms"])[len(passes) // 2]
    return BenchRow(
        engine="moe-chat",
        budget=str(model.config.expert_budget),
        cache_slots=model.cache.n_slots,
        tpot_ms=median["tpot_ms"],
        tokens_per_s=1e3 / median["tpot_ms"],
        prefill_tokens_per_s=statistics.median(p["prefill_tps"] for p in passes),
        hit_rate=median["hit_rate"],
        h2d_gbps=median["h2d_gbps"],
        bytes_per_token=median["bytes_per_token"],
        decode_tokens=median["decode_tokens"],
        simulated_link=model.simulated_link,
        peak_rss_bytes=peak_rss_bytes() if peak_rss is None else peak_rss,
        pinned_bytes=pinned_bytes(model),
        store_bytes=model.store.nbytes,
        baseline_rss_bytes=baseline_rss,
        resident_bytes=model.info().resident_nbytes,
        kv_bytes=kv_cache_bytes(model, tokens),
        in_place=model.cache.in_place,
        copy_hidden=median["copy_hidden"],
        huge_page_bytes=huge_pages.backed_bytes(),
        step_path=max(median["step_paths"], key=median["step_paths"].get, default=None),
        step_paths=median["step_paths"],
        step_path_declined=median["step_path_declined"],
    )


def pinned_bytes(model) -> int:
    """Host memory pinned for the link: the whole store, or the staging ring's buffers."""
    return model.store.nbytes if model.store.pinned else getattr(model.transfer, "staging_nbytes", 0)


def bench_engine(
    model,
    prompt_ids: list[list[int]],
    new_tokens: int,
    repeats: int,
    baseline_rss: int | None = None,
    decoding: GenerationConfig | None = None,
) -> BenchRow:
    engine_pass(model, [prompt_ids[0][:8]], 4, decoding)  # warm-up
    passes = [engine_pass(model, prompt_ids, new_tokens, decoding) for _ in range(repeats)]
    return engine_row(model, passes, baseline_rss, max(map(len, prompt_ids)) + new_tokens)
