"""Profile a loaded model on this machine: the times and sizes auto-tune's models need.

`profile_model(model, drafter_dir)` measures, on a loaded `OffloadedModel`:

- one decoder layer's decode time with its experts resident (one token's forward over a
  short prompt, divided by the layer count, as `engine.bench.compare.calibrate_link` does);
- one draft token of the drafter (loaded with the engine's own `load_draft_model`);
- one expert's host→device copy (`engine.speculative.prefetch.measure_load_ms`);
- one target forward over t = 1…16 tokens, as verification runs it;
- the resident (non-expert) weights, the KV cache per token (measured from the cache a
  short prompt produces, so every attention layout counts right) and the peak device
  memory other than the expert cache for `context_tokens` of context;
- each drafter's per-token acceptance α and draft token time on a few calibration prompts
  (greedy, a fixed draft length): the draft model, self-speculation, substitutes, MTP.

Timed forwards run on a KV cache that is rewound after each run; each input is run
once before timing, so its experts are resident (a cache that holds every expert is
filled first). Every time is the median of a few runs. On a CUDA device the peak is
`torch.cuda.max_memory_allocated` over a chunked prefill of the context (at most
`PEAK_TOKENS` tokens; the KV of the rest is added) less the expert cache's pool; a
loaded drafter counts, as it needs the same memory. On a CPU device it is estimated
as weights + drafter + KV (`Profile.peak_is_estimate`). `progress(stage, done, total)`
is called as each stage starts; `cancel` raises `GenerationCancelled` between stages.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import DynamicCache

from engine.errors import GenerationCancelled, InvalidRequestError
from engine.generation import FinishedEvent, generate, generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.model.hf_calls import with_cache
from engine.model.kv_cache import RecurrentState, rewind_cache
from engine.prompts import PROMPTS
from engine.speculative.draft_len import alpha_from_acceptance
from engine.speculative.drafters import load_draft_model
from engine.speculative.prefetch import measure_load_ms
from engine.text.prompt_ids import encode_prompt
from engine.tune.types import DrafterProfile, Profile

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]  # (stage, done, total)

STAGES = ("copy", "layer", "draft", "verify", "memory", "acceptance")
MAX_VERIFY_TOKENS = 16
VERIFY_TOKENS = range(1, MAX_VERIFY_TOKENS + 1)  # the verify forwards timed
PROMPT_TOKENS = 16  # the short prompt timed forwards continue
TIMED_RUNS = 5
UNIQUE_TOKENS = 32  # generated per calibration prompt to measure routing overlap
PEAK_TOKENS = 8192  # the longest context actually prefilled to measure the peak
PREFILL_CHUNK = GenerationConfig().prefill_chunk
ALPHA_TOKENS = 24  # generated per calibration prompt to measure α
ALPHA_DRAFT_LEN = 4


def profile_model(
    model,
    drafter_dir: str | None = None,
    context_tokens: int = 4096,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    drafters: Sequence[str] | None = None,
) -> Profile:
    """Measure `model` (an `OffloadedModel`) and each of `drafters` ("draft": the draft model in
    `drafter_dir`; "self", "substitute", "mtp": `SpecConfig` modes drafting from the model itself);
    `drafters` None: the draft model alone, where `drafter_dir` is given."""
    drafters = _checked_drafters(drafters, drafter_dir)
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be at least 1, got {context_tokens}")
    info = model.info()
    ids = _token_ids(model.hf_config.vocab_size, PROMPT_TOKENS + MAX_VERIFY_TOKENS, model.device)
    prompt, continuation = ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:]

    stage = _stage_reporter(progress, cancel)
    stage(0)
    load_ms = measure_load_ms(model)  # first: the timed forwards below subtract the copies they make
    stage(1)
    _warm_cache(model)
    kv_cache = model.new_kv_cache(rewindable=True)  # keeps every position: exact per-token bytes
    model.forward(prompt, kv_cache)
    kv_bytes_per_token = _kv_nbytes(kv_cache) // PROMPT_TOKENS
    layer_ms = _forward_ms(model, kv_cache, continuation[:1], 1, load_ms)
    layer_ms /= model.hf_config.num_hidden_layers
    stage(2)
    draft_ms = _draft_token_ms(model, drafter_dir, prompt, continuation[:1]) if "draft" in drafters else None
    stage(3)
    verify_ms = tuple(_forward_ms(model, kv_cache, continuation[:t], 0, load_ms) for t in VERIFY_TOKENS)
    stage(4)
    peak, estimated = _peak_non_expert_bytes(model, info.resident_nbytes, kv_bytes_per_token, context_tokens)
    stage(5)
    measured = _drafter_profiles(model, drafters, drafter_dir, draft_ms, cancel)
    unique = _unique_experts_measured(model)
    if progress is not None:
        progress("done", len(STAGES), len(STAGES))
    return Profile(
        model=info.path,
        model_type=info.model_type,
        moe_layers=info.moe_layers,
        num_experts=info.num_experts,
        top_k=info.top_k,
        expert_nbytes=info.expert_nbytes,
        target_layer_ms=layer_ms,
        draft_token_ms=measured[0].token_ms if measured else None,
        expert_load_ms=load_ms,
        verify_ms=verify_ms,
        non_expert_bytes=info.resident_nbytes,
        kv_bytes_per_token=kv_bytes_per_token,
        context_tokens=context_tokens,
        peak_non_expert_bytes=peak,
        acceptance_rate=measured[0].acceptance_rate if measured else None,
        peak_is_estimate=estimated,
        unique_experts_measured=unique,
        drafters=measured,
    )


def _checked_drafters(drafters: Sequence[str] | None, drafter_dir: str | None) -> Sequence[str]:
    """The drafters to profile: the draft model alone by default, where its folder is given."""
    if drafters is None:
        return ("draft",) if drafter_dir else ()
    if "draft" in drafters and not drafter_dir:
        raise ValueError("the draft model's folder is needed to profile it")
    return drafters


def _stage_reporter(progress: Progress | None, cancel: threading.Event | None) -> Callable[[int], None]:
    """`stage(i)`: stop if cancelled, else report that stage i starts."""

    def stage(index: int) -> None:
        if cancel is not None and cancel.is_set():
            raise GenerationCancelled("Profiling was cancelled.")
        if progress is not None:
            progress(STAGES[index], index, len(STAGES))

    return stage


def _token_ids(vocab_size: int, n: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """`n` fixed pseudo-random token ids `[n]` (timing does not depend on which)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (n,), generator=generator).to(device)


def _warm_cache(model) -> None:
    """Copy every expert in when the cache holds them all (else timed inputs warm their own)."""
    cache, store = model.cache, model.store
    if cache.n_slots < store.total_experts:
        return
    for layer in store.layer_indices:
        for expert in range(store.num_experts):
            slot = cache.acquire((layer, expert))
            try:
                cache.wait(slot)
            finally:
                cache.release(slot)


def _kv_nbytes(kv_cache: DynamicCache) -> int:
    """Bytes of every key and value tensor the cache holds (layers without attention hold none)."""
    total = 0
    for layer in kv_cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def _forward_ms(
    model, kv_cache: DynamicCache, ids: torch.Tensor, logits_to_keep: int, load_ms: float
) -> float:
    """Median compute ms of one target forward of `ids` after the cached prompt (rewound after each).

    When the expert cache cannot keep the experts these tokens route to resident, each timed run
    also copies experts in; their copy time (misses per run × `load_ms`, copies being serialized
    with compute on demand) is subtracted, so the figure stays compute."""
    base = kv_cache.get_seq_length()
    saved = RecurrentState.save(kv_cache)  # linear-attention state goes back by copy, not by crop
    misses_before = model.cache.stats.total().misses

    def run() -> None:
        try:
            model.forward(ids, kv_cache, logits_to_keep=logits_to_keep)
        finally:
            rewind_cache(kv_cache, base, saved)

    run()  # warm-up: the same tokens route to the same experts, now resident
    misses_warm = model.cache.stats.total().misses
    ms = _median_ms(run, model.device)
    misses = model.cache.stats.total().misses - misses_warm
    if misses:
        ms = max(ms - misses / TIMED_RUNS * load_ms, ms * 0.05)
        log.info(
            "Profiling a forward of %d token(s) missed the expert cache %d time(s) (%d on warm-up): "
            "the cache cannot keep its experts resident; their copy time was subtracted.",
            len(ids),
            misses,
            misses_warm - misses_before,
        )
    return ms


def _median_ms(fn: Callable[[], object], device: torch.device, runs: int = TIMED_RUNS) -> float:
    times = []
    for _ in range(runs):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def _draft_token_ms(model, drafter_dir: str, prompt: torch.Tensor, token: torch.Tensor) -> float:
    """Median ms of one draft token: the whole draft model's forward of one token after the prompt."""
    draft = load_draft_model(drafter_dir, model)
    kv_cache = DynamicCache()
    draft(**with_cache(draft, kv_cache, input_ids=prompt.view(1, -1), use_cache=True, logits_to_keep=1))
    base = kv_cache.get_seq_length()

    def run() -> None:
        draft(**with_cache(draft, kv_cache, input_ids=token.view(1, -1), use_cache=True, logits_to_keep=1))
        rewind_cache(kv_cache, base)

    run()  # warm-up
    return _median_ms(run, model.device)


def _peak_non_expert_bytes(
    model, resident_nbytes: int, kv_bytes_per_token: int, context_tokens: int
) -> tuple[int, bool]:
    """(peak device bytes other than the expert cache, whether it is an estimate)."""
    if model.device.type != "cuda":
        return resident_nbytes + model.drafter_nbytes() + kv_bytes_per_token * context_tokens, True
    limit = getattr(model.hf_config, "max_position_embeddings", None) or PEAK_TOKENS
    measured_tokens = min(context_tokens, PEAK_TOKENS, limit)
    ids = _token_ids(model.hf_config.vocab_size, measured_tokens, model.device)
    torch.cuda.synchronize(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    kv_cache = model.new_kv_cache(rewindable=True)  # as speculative decoding keeps it: every position
    for start in range(0, measured_tokens, PREFILL_CHUNK):
        model.forward(ids[start : start + PREFILL_CHUNK], kv_cache)
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device)
    del kv_cache
    pool = model.cache.pool.numel() * model.cache.pool.element_size()
    unmeasured = kv_bytes_per_token * (context_tokens - measured_tokens)
    return peak - pool + unmeasured, False


def _drafter_profiles(
    model, drafters: Sequence[str], drafter_dir: str | None, draft_ms: float | None, cancel
) -> tuple[DrafterProfile, ...]:
    """Each drafter that drafted on this model, as `_drafter_profile` measures it."""
    measured = (_drafter_profile(model, name, drafter_dir, draft_ms, cancel) for name in drafters)
    return tuple(profile for profile in measured if profile is not None)


def _drafter_profile(
    model, name: str, drafter_dir: str | None, draft_ms: float | None, cancel: threading.Event | None
) -> DrafterProfile | None:
    """One drafter's per-token acceptance α (MoESD's model) and draft token time, from greedy
    runs on the calibration prompts at a fixed draft length. α is fitted to the runs' accepted /
    drafted ratio at their mean draft length, since that ratio counts the positions after a
    rejection as failures too and would understate α. The draft model's token time is
    `draft_ms` (timed apart, without its prompt's catch-up); the others' is the runs' own. None
    where the drafter drafted nothing (it cannot run on this model)."""
    spec = SpecConfig(
        mode=name,
        draft_model=str(Path(drafter_dir)) if name == "draft" else None,
        draft_len=ALPHA_DRAFT_LEN,
        adapt_draft_len=False,
    )
    config = GenerationConfig(
        max_new_tokens=ALPHA_TOKENS, sampling=SamplingConfig(greedy=True), ignore_eos=True, spec=spec
    )
    drafted = accepted = emitted = drafting_ms = 0.0
    steps = 0
    for prompt in _calibration_prompts(model):
        try:
            events = list(generate(model, prompt, config, cancel))
        except InvalidRequestError as err:  # a drafter this model refuses (substitutes of a GGUF's blocks)
            log.info("tune: %s cannot draft here: %s", name, err)
            return None
        finished = events[-1]
        assert isinstance(finished, FinishedEvent)
        if finished.reason == "cancelled":
            raise GenerationCancelled("Profiling was cancelled.")
        stats = finished.stats
        if stats.acceptance_rate is None or stats.draft_len is None:
            continue
        steps_drafted = stats.draft_len * stats.verify_steps
        steps += stats.verify_steps
        drafted += steps_drafted
        accepted += stats.acceptance_rate * steps_drafted
        emitted += (stats.accept_len or 0.0) * stats.verify_steps
        drafting_ms += (stats.draft_token_ms or 0.0) * steps_drafted
    if not drafted:
        log.info("tune: %s drafted nothing on this model", name)
        return None
    alpha = alpha_from_acceptance(accepted / drafted, drafted / steps)
    token_ms = draft_ms if name == "draft" and draft_ms is not None else drafting_ms / drafted
    return DrafterProfile(name, token_ms, alpha, ALPHA_DRAFT_LEN, emitted / steps, drafted / steps)


@torch.inference_mode()
def _unique_experts_measured(model) -> tuple[float, ...] | None:
    """Mean unique experts per MoE layer over windows of t = 1…16 consecutive generated tokens.

    Real text routes consecutive tokens to overlapping experts, so this is below MoESD's
    uniform N(t); it is read from the router logits of one forward over each calibration
    prompt and its greedy continuation (top-k of the logits: the routers' own rule for
    softmax-then-top-k models, an approximation for biased routers)."""
    windows: list[list[float]] = [[] for _ in range(MAX_VERIFY_TOKENS)]
    greedy = GenerationConfig(max_new_tokens=UNIQUE_TOKENS, sampling=SamplingConfig(greedy=True))
    for prompt in _calibration_prompts(model):
        prompt_ids = encode_prompt(model, prompt)
        reply = generate_text(model, prompt_ids, replace(greedy, ignore_eos=True))
        ids = torch.tensor(prompt_ids + list(reply.token_ids), device=model.device)
        model.trace.clear()
        # every position's logits kept: else the last layer routes the last position only
        model.forward(ids, model.new_kv_cache(), logits_to_keep=0)
        for logits in model.trace.logits.values():  # [T, E] per MoE layer
            if logits.dim() != 2 or logits.shape[0] != len(ids):
                return None  # a router whose output is not per-token logits: not measurable here
            routes = logits[len(prompt_ids) :].topk(model.top_k, dim=-1).indices.tolist()
            for t in range(1, MAX_VERIFY_TOKENS + 1):
                for start in range(len(routes) - t + 1):
                    windows[t - 1].append(len({e for row in routes[start : start + t] for e in row}))
    model.trace.clear()
    if not all(windows):
        return None
    return tuple(statistics.fmean(counts) for counts in windows)


def _calibration_prompts(model) -> list:
    if model.tokenizer is not None:
        return list(PROMPTS)
    vocab = model.hf_config.vocab_size
    return [
        _token_ids(vocab, PROMPT_TOKENS, torch.device("cpu"), seed).tolist() for seed in range(len(PROMPTS))
    ]
