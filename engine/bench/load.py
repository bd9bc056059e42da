"""Load-time benchmark of the converted-store cache: `python -m engine.bench.load [--model DIR]`.

Loads the model twice with quantized experts: cold, with an empty temporary
store cache (the experts are read, converted and the cache entry written), then
warm (the converted store is read back from the cache). Prints, for both, the
time of the expert-store stage (from the loader's first to its last "experts"
progress report) and of the whole `load_model`, and the cold/warm ratios. The
default model is the bundled demo MoE.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass

from engine.config import EXPERT_DTYPES, OffloadConfig
from engine.errors import EngineError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadTiming:
    store_s: float  # the expert-store stage: read and convert, or read the cache entry
    total_s: float  # the whole load_model call


def timed_load(model_dir: str, config: OffloadConfig) -> LoadTiming:
    """Load and close the model once, timing its expert-store stage and the whole load."""
    from engine.loader import load_model

    stamps: list[float] = []

    def progress(stage: str, _done: int, _total: int) -> None:
        if stage == "experts":
            stamps.append(time.perf_counter())

    start = time.perf_counter()
    model = load_model(model_dir, config, progress)
    total = time.perf_counter() - start
    model.close()
    return LoadTiming(store_s=stamps[-1] - stamps[0], total_s=total)


def cold_and_warm(model_dir: str, config: OffloadConfig) -> tuple[LoadTiming, LoadTiming]:
    """A load with an empty store cache, then one that finds the entry the first wrote."""
    saved = os.environ.get("MOE_CHAT_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="moe-chat-bench-load-") as cache_root:
        os.environ["MOE_CHAT_CACHE_DIR"] = cache_root
        try:
            return timed_load(model_dir, config), timed_load(model_dir, config)
        finally:
            if saved is None:
                del os.environ["MOE_CHAT_CACHE_DIR"]
            else:
                os.environ["MOE_CHAT_CACHE_DIR"] = saved


def report(model_dir: str, config: OffloadConfig, cold: LoadTiming, warm: LoadTiming) -> str:
    rows = [
        f"model: {model_dir}",
        f"expert dtype: {config.expert_dtype}, device: {config.device}, dtype: {config.dtype}",
        f"{'':<20}{'cold (convert)':>16}{'warm (cache)':>16}{'cold/warm':>12}",
    ]
    for label, cold_s, warm_s in (
        ("expert store", cold.store_s, warm.store_s),
        ("whole load_model", cold.total_s, warm.total_s),
    ):
        rows.append(f"{label:<20}{cold_s * 1e3:>13.1f} ms{warm_s * 1e3:>13.1f} ms{cold_s / warm_s:>11.1f}×")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.load", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled demo MoE)")
    parser.add_argument("--expert-dtype", default="int4", choices=[d for d in EXPERT_DTYPES if d != "native"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", help="compute dtype: auto, float32, bfloat16, float16")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from engine.resources import demo_model_dir

        model_dir = args.model or str(demo_model_dir())
        config = OffloadConfig(device=args.device, dtype=args.dtype, expert_dtype=args.expert_dtype)
        config.validate()
        timed_load(model_dir, OffloadConfig(device=args.device, dtype=args.dtype))  # imports, file cache
        cold, warm = cold_and_warm(model_dir, config)
    except EngineError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    sys.stdout.write(report(model_dir, config, cold, warm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
