"""Command-line options shared by every front-end that loads a model and generates.

`python -m engine`, `python -m engine.bench`, the terminal chat and the server
build their parsers from these and turn the parsed options into the engine's
frozen configs. Imports no torch; may import only the engine's base modules.

One name, one meaning, in every command:

- `--spec` and `--prefetch` default to `auto`: the model's drafter (its bundled
  draft, else the checkpoint's MTP layer, else `self`) with SP-MoE prefetch, at the stored auto-tune result's
  settings where there is one (`engine.speculative.auto`); `none` turns each off.
- `--sim-link LINK` (no GPU): the simulated host→device link, either a bandwidth
  in GB/s (`16`) or `calibrated` (one expert's copy takes 3× one layer's decode,
  measured on this host: `python -m engine` and `python -m engine.bench` measure
  it, the terminal chat and the server refuse it). `--sim-link-gbps N` is the
  older spelling of `--sim-link N`.
"""

from __future__ import annotations

import argparse

from engine.config import KV_DTYPE_ALIASES, KV_DTYPES
from engine.errors import InvalidRequestError
from engine.generation_config import (
    AUTO,
    PREFETCH_CHOICES,
    SPEC_CHOICES,
    GenerationConfig,
    SamplingConfig,
    SpecConfig,
)

CALIBRATED = "calibrated"
SIM_LINK_HELP = (
    "without a GPU: simulate the host→device link, either a bandwidth in GB/s (16) or 'calibrated' "
    "(one expert's copy takes 3× one layer's decode on this host, as Qwen3-30B-A3B on an RTX 4090); "
    "figures measured so are labelled simulated"
)


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that loads a model."""
    parser.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: the bundled demo model)"
    )
    parser.add_argument(
        "--expert-budget",
        default=None,
        help="device memory for cached experts: a size (2GiB, 512MB), a number of experts (64), or 'all'",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        type=lambda name: KV_DTYPE_ALIASES.get(name, name),
        choices=KV_DTYPES,
        help="KV cache storage precision (fp32, bf16, fp16, fp8 = float8_e4m3fn with per-head scales); "
        "auto: the compute dtype. Smaller leaves more device memory for experts",
    )
    parser.add_argument(
        "--ctx-size",
        type=int,
        default=None,
        help="context length in tokens (prompt + reply), below the model's window; the auto expert budget "
        "leaves room for its KV cache (default: the model's)",
    )
    parser.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "exact", "ggml"),
        help="on the CPU: ggml (llama.cpp's own kernels, prebuilt, on a GGUF's blocks, BF16/F16/MXFP4 "
        "and symmetric GPTQ experts: faster, activations in 8 bits for quantized ones as llama.cpp computes "
        "them), exact (outputs equal the dequantized model's; FP8 and AWQ always), or auto (default: ggml "
        "where it runs here)",
    )
    parser.add_argument("--policy", default="lru", choices=("lru", "lfu", "mrs"), help="cache eviction")
    parser.add_argument(
        "--expert-dtype",
        default="native",
        choices=("native", "int8", "int4"),
        help="routed experts' precision in host memory: int8/int4 copy fewer bytes but change outputs",
    )
    parser.add_argument(
        "--sim-link-gbps", type=float, default=None, help="same as --sim-link GBPS (the older spelling)"
    )
    parser.add_argument("--sim-latency-us", type=float, default=10.0, help="simulated link latency per copy")


def add_sim_link_argument(parser: argparse.ArgumentParser) -> None:
    """`--sim-link calibrated|GBPS`, the one definition every command shares."""
    parser.add_argument("--sim-link", type=parse_sim_link, default=None, metavar="LINK", help=SIM_LINK_HELP)


def parse_sim_link(text: str) -> str | float:
    """`calibrated`, or a bandwidth in GB/s (a number > 0)."""
    if text.strip().lower() == CALIBRATED:
        return CALIBRATED
    try:
        gbps = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"give a bandwidth in GB/s (16) or 'calibrated', not {text!r}"
        ) from None
    if not gbps > 0:  # `not >` also rejects NaN
        raise argparse.ArgumentTypeError(f"the simulated link needs a bandwidth > 0 GB/s, got {text!r}")
    return gbps


def sim_link_gbps(args: argparse.Namespace) -> float | None:
    """The simulated link's GB/s that --sim-link or --sim-link-gbps give (None: calibrated, or none)."""
    link = getattr(args, "sim_link", None)
    older = getattr(args, "sim_link_gbps", None)
    if isinstance(link, float) and older is not None and older != link:
        raise InvalidRequestError(f"--sim-link {link:g} and --sim-link-gbps {older:g} disagree: give one.")
    return link if isinstance(link, float) else older


def wants_calibrated_link(args: argparse.Namespace) -> bool:
    return getattr(args, "sim_link", None) == CALIBRATED


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding and expert prefetch options."""
    parser.add_argument(
        "--spec",
        default=AUTO,
        choices=SPEC_CHOICES,
        help="speculative decoding: auto (default: the model's draft model, else its MTP layer, else self), "
        "a draft model, the target's own top-r experts (SS-MoE self), resident low-bit substitute experts "
        "(SubSpec), the checkpoint's multi-token-prediction layer (mtp), or none",
    )
    parser.add_argument(
        "--draft-model", default=None, help="draft model folder (default: the demo draft for the demo model)"
    )
    parser.add_argument("--draft-len", type=int, default=4, help="draft tokens per verify step (start value)")
    parser.add_argument("--fixed-draft-len", action="store_true", help="never adapt the draft length")
    parser.add_argument("--max-draft-len", type=int, default=16)
    parser.add_argument("--top-r", type=int, default=1, help="--spec self: experts per token while drafting")
    parser.add_argument(
        "--cached-only", action="store_true", help="--spec self: draft from cached experts only"
    )
    parser.add_argument("--substitute-bits", type=int, default=4, choices=(4, 8))
    parser.add_argument(
        "--tau",
        type=float,
        default=SpecConfig.confidence_tau,
        help="end a draft at a token the draft gives less than this probability (0: never)",
    )
    parser.add_argument(
        "--adaptive-accept",
        action="store_true",
        help="SS-MoE adaptive acceptance: faster, NOT lossless (outputs may differ from the model's)",
    )
    parser.add_argument(
        "--prefetch",
        default=AUTO,
        choices=PREFETCH_CHOICES,
        help="expert prefetch: auto (default: spmoe when speculating, else none), or one policy",
    )
    parser.add_argument(
        "--cutoff", type=int, default=None, help="spmoe: last MoE layer prefetched (default: auto)"
    )
    parser.add_argument(
        "--cpu-experts",
        default="never",
        choices=("auto", "never", "always"),
        help="compute missing experts on the CPU when the measured cost model says it is sooner (GPU only)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    """Sampling and length options of a generation request."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="always generate --max-new-tokens (benchmarks, tests)"
    )


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The GenerationConfig the sampling and speculation options say (imports no torch)."""
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            greedy=args.greedy,
        ),
        stop_strings=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        spec=spec_config(args),
        prefetch=args.prefetch,
        cutoff=args.cutoff,
        cpu_experts=args.cpu_experts,
    )


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """The SpecConfig the options say; `--spec draft|auto` on the demo model drafts with the demo draft."""
    draft_model = args.draft_model
    if args.spec in ("draft", AUTO) and draft_model is None and not args.model:
        from engine.resources import demo_draft_dir

        draft_model = str(demo_draft_dir())
    return SpecConfig(
        mode=args.spec,
        draft_model=draft_model,
        draft_len=args.draft_len,
        adapt_draft_len=not args.fixed_draft_len,
        max_draft_len=args.max_draft_len,
        top_r=args.top_r,
        cached_only=args.cached_only,
        substitute_bits=args.substitute_bits,
        confidence_tau=args.tau,
        acceptance="adaptive" if args.adaptive_accept else "lossless",
    )


def model_folder(args: argparse.Namespace) -> str:
    """--model, or the bundled demo model when none is given."""
    if args.model:
        return args.model
    from engine.resources import demo_model_dir

    return str(demo_model_dir())


def offload_config(args: argparse.Namespace, expert_budget: str | None = None):
    """The OffloadConfig the options say; `expert_budget` overrides --expert-budget (bench sweeps)."""
    from engine.config import ExpertBudget, OffloadConfig

    return OffloadConfig(
        device=args.device,
        dtype=args.dtype,
        expert_budget=ExpertBudget.parse(expert_budget if expert_budget is not None else args.expert_budget),
        policy=args.policy,
        sim_link_gbps=sim_link_gbps(args),
        sim_latency_us=args.sim_latency_us,
        expert_dtype=args.expert_dtype,
        kv_dtype=args.kv_dtype,
        context_length=args.ctx_size,
        kernels=args.kernels,
    )
