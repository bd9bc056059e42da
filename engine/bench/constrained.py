"""What constrained decoding costs a token: `python -m engine.bench.constrained [--model DIR]`.

Two figures, on the bundled demo model unless `--model` says otherwise:
- the engine's `tpot_ms` for the same sampled request with and without a json_schema
  `response_format` (alternated, `--runs` each, every reply exactly `--new-tokens` long; the medians);
- the grammar's own work a token, apart from the model: filling the token mask, applying it to a
  row of scores and advancing the grammar by one token, over a fixed JSON reply the schema
  accepts, with llguidance (what engine.constraints uses) and, when it is installed, xgrammar;
  with each library's grammar compile time (paid once a request).

The schema is a long string field, so a reply stays inside the JSON for the whole run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 400},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REPLY = {"name": "Old MacDonald had a farm " * 6, "age": 62, "tags": ["cows", "pigs", "hens"]}
ASK = [{"role": "user", "content": "Describe a farmer as JSON."}]


def engine_tpot(model, new_tokens: int, runs: int) -> dict[str, float]:
    """Median tpot_ms of free and json_schema replies, alternated so a busy machine hits both alike."""
    from engine.generation import generate_text
    from engine.generation_config import GenerationConfig, SamplingConfig

    response_format = {"type": "json_schema", "json_schema": {"name": "farmer", "schema": SCHEMA}}
    tpot: dict[str, list[float]] = {"free": [], "json_schema": []}
    for run in range(runs):
        for label, fmt in (("free", None), ("json_schema", response_format)):
            sampling = SamplingConfig(temperature=1.0, seed=run)
            config = GenerationConfig(
                max_new_tokens=new_tokens, sampling=sampling, ignore_eos=True, response_format=fmt
            )
            tpot[label].append(generate_text(model, ASK, config).stats.tpot_ms)
    return {label: statistics.median(values) for label, values in tpot.items()}


def _per_token(ids: list[int], step: Callable[[int], None]) -> float:
    """Median seconds of `step(token)` over `ids`."""
    times = []
    for token in ids:
        started = time.perf_counter()
        step(token)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def llguidance_cost(tokenizer, vocab_size: int, ids: list[int]) -> tuple[float, float]:
    """(grammar compile s, median s a token) with llguidance, as engine.constraints calls it."""
    import llguidance
    import llguidance.hf
    import llguidance.numpy
    import numpy as np

    lltokenizer = llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=vocab_size, eos_token=[tokenizer.eos_token_id]
    )
    started = time.perf_counter()
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    matcher = llguidance.LLMatcher(
        lltokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    )
    compile_s = time.perf_counter() - started
    mask, scores = (
        llguidance.numpy.allocate_token_bitmask(1, vocab_size),
        np.zeros((1, vocab_size), np.float32),
    )

    def step(token: int) -> None:
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        llguidance.numpy.apply_token_bitmask_inplace(scores, mask)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")

    return compile_s, _per_token(ids, step)


def xgrammar_cost(tokenizer, vocab_size: int, ids: list[int]) -> tuple[float, float] | None:
    """The same with xgrammar; None when it is not installed."""
    try:
        import xgrammar
    except ImportError:
        return None
    import torch

    info = xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=[tokenizer.eos_token_id]
    )
    compiler = xgrammar.GrammarCompiler(info)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - started
    matcher = xgrammar.GrammarMatcher(compiled)
    mask, scores = xgrammar.allocate_token_bitmask(1, vocab_size), torch.zeros((1, vocab_size))

    def step(token: int) -> None:
        matcher.fill_next_token_bitmask(mask)
        xgrammar.apply_token_bitmask_inplace(scores, mask)
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")

    return compile_s, _per_token(ids, step)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled demo model)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=6, help="replies of each kind")
    args = parser.parse_args(argv)
    from engine.config import OffloadConfig
    from engine.loader import load_model
    from engine.resources import demo_model_dir

    model = load_model(args.model or demo_model_dir(), OffloadConfig(device=args.device))
    try:
        tpot = engine_tpot(model, args.new_tokens, args.runs)
        tokenizer, vocab_size = model.tokenizer, model.hf_config.vocab_size
    finally:
        model.close()
    extra = (tpot["json_schema"] - tpot["free"]) / tpot["free"]
    print(f"engine tpot_ms: free {tpot['free']:.2f}, json_schema {tpot['json_schema']:.2f} ({extra:+.1%})")
    ids = tokenizer(json.dumps(REPLY, separators=(",", ":")))["input_ids"]
    for name, cost in (("llguidance", llguidance_cost), ("xgrammar", xgrammar_cost)):
        measured = cost(tokenizer, vocab_size, ids)
        if measured is None:
            print(f"{name}: not installed")
            continue
        compile_s, token_s = measured
        print(
            f"{name}: compile {compile_s * 1e3:.2f} ms, mask + apply + advance "
            f"{token_s * 1e6:.1f} us a token ({len(ids)} tokens, vocabulary {vocab_size})"
        )


if __name__ == "__main__":
    main()
