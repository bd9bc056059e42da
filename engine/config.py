"""Frozen configuration of the offloaded engine, and parsing of user-given sizes.

`OffloadConfig` says where the model runs, how much device memory the expert
cache may use and in which precision the routed experts are kept; it is
validated once, when the model is loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import InvalidRequestError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CACHE_POLICIES: tuple[str, ...] = ("lru", "lfu", "mrs")  # engine.device_cache.eviction builds them
# Routed experts as the checkpoint has them, or group-wise quantized (engine.formats.int_quant): opt-in,
# because quantized experts change the model's outputs.
EXPERT_DTYPES = ("native", "int8", "int4")
# The KV cache's storage precision, apart from the compute dtype (engine.model.kv_cache): auto keeps
# the compute dtype; float8_e4m3fn stores a byte per element with a per-head scale.
KERNELS = ("auto", "exact", "ggml")  # auto: ggml where it can compute the file, at load
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "float8_e4m3fn")
KV_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}


@dataclass(frozen=True)
class ExpertBudget:
    """A device budget for the expert cache: bytes, a number of experts, everything, or auto.

    Auto (nothing given) fills the device memory left after the resident weights and a
    headroom for activations and the KV cache; on a CPU device it caches everything.
    """

    nbytes: int | None = None
    experts: int | None = None
    all_experts: bool = False

    @classmethod
    def parse(cls, text: str | int | None) -> ExpertBudget:
        """'2GiB', '512MB', '1.5G' are bytes; a bare integer ('64') is a number of experts;
        'all' caches every expert; None, '' or 'auto' sizes the cache from free device memory."""
        if text is None or (isinstance(text, str) and text.strip().lower() in ("", "auto")):
            return cls()
        if isinstance(text, str) and text.strip().lower() == "all":
            return cls(all_experts=True)
        if isinstance(text, int):
            return cls._experts(text)
        match = _SIZE.match(text)
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise InvalidRequestError(
                f"Cannot read expert budget {text!r}: give a size such as 2GiB or 512MB, "
                "a number of experts such as 64, or 'all'."
            )
        if unit == "":
            if "." in match.group(1):
                raise InvalidRequestError(f"Expert budget {text!r}: a number of experts must be whole.")
            return cls._experts(int(match.group(1)))
        nbytes = int(float(match.group(1)) * _UNITS[unit])
        if nbytes <= 0:
            raise InvalidRequestError(f"Expert budget {text!r} must be larger than zero.")
        return cls(nbytes=nbytes)

    @classmethod
    def _experts(cls, count: int) -> ExpertBudget:
        if count <= 0:
            raise InvalidRequestError(f"Expert budget of {count} experts must be at least 1.")
        return cls(experts=count)

    @property
    def is_auto(self) -> bool:
        return self.nbytes is None and self.experts is None and not self.all_experts

    def slots(self, expert_nbytes: int, total_experts: int, auto_nbytes: int | None = None) -> int:
        """How many expert slots this budget buys, never more than there are experts.

        `auto_nbytes` is the device memory an auto budget may use (None: no limit)."""
        if self.experts is not None:
            return min(self.experts, total_experts)
        nbytes = self.nbytes if self.nbytes is not None else (None if self.all_experts else auto_nbytes)
        if nbytes is not None:
            return min(max(nbytes, 0) // expert_nbytes, total_experts)
        return total_experts

    def __str__(self) -> str:
        if self.experts is not None:
            return f"{self.experts} expert{'s' if self.experts != 1 else ''}"
        if self.nbytes is not None:
            return format_bytes(self.nbytes)
        return "all experts" if self.all_experts else "auto"


def format_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class OffloadConfig:
    """Where the model runs and how its routed experts are cached."""

    device: str = "auto"  # auto | cpu | cuda[:N]
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    expert_budget: ExpertBudget = ExpertBudget()
    policy: str = "lru"  # lru | lfu | mrs
    sim_link_gbps: float | None = None  # simulated host→device link (CPU device only)
    sim_latency_us: float = 10.0
    mrs_alpha: float = 0.5
    expert_dtype: str = "native"  # native | int8 | int4
    kv_dtype: str = "auto"  # auto (the compute dtype) | float32 | bfloat16 | float16 | float8_e4m3fn
    # tokens a chat may hold (prompt + reply), below the model's own window (llama.cpp's -c, Ollama's
    # num_ctx): requests past it are refused, and the auto expert budget leaves room for its KV cache
    context_length: int | None = None  # None: the model's window
    # how the CPU computes the model: "exact" (torch, outputs equal the dequantized model's) or
    # "ggml" (llama.cpp's own kernels, engine.ggml.library, on a GGUF's blocks and BF16/F16/MXFP4
    # experts: a GGUF's activations in 8 bits, as llama.cpp computes); "auto" (the command line's
    # and the app's default) is ggml where ggml computes the checkpoint as it is
    # (engine.store.placement.ggml_computes) and its library runs here, else exact: a loaded
    # model's config holds what it resolved to
    kernels: str = "exact"

    def validate(self) -> None:
        if self.device.split(":")[0] not in DEVICES:
            raise InvalidRequestError(f"Unknown device {self.device!r}; choose one of {', '.join(DEVICES)}.")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"Unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}.")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise InvalidRequestError(
                f"Unknown expert dtype {self.expert_dtype!r}; choose one of {', '.join(EXPERT_DTYPES)} "
                "(native keeps the checkpoint's precision; int8 and int4 quantize the routed experts)."
            )
        length = self.context_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 16):
            raise InvalidRequestError(
                "The context length must be a whole number of tokens >= 16 (none: the model's), "
                f"got {length!r}."
            )
        if self.kernels not in KERNELS:
            raise InvalidRequestError(f"Unknown kernels {self.kernels!r}; choose one of {', '.join(KERNELS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidRequestError(
                f"Unknown KV cache dtype {self.kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}."
            )
        if self.policy.lower() not in CACHE_POLICIES:
            raise InvalidRequestError(
                f"Unknown cache policy {self.policy!r}; choose one of {', '.join(CACHE_POLICIES)}."
            )
        if self.sim_link_gbps is not None and not self.sim_link_gbps > 0:  # `not >` also rejects NaN
            raise InvalidRequestError(
                f"--sim-link-gbps must be a positive bandwidth in GB/s, got {self.sim_link_gbps}."
            )
        if not self.sim_latency_us >= 0:
            raise InvalidRequestError("The simulated link latency cannot be negative.")
        if not 0 < self.mrs_alpha <= 1:
            raise InvalidRequestError("The MRS averaging coefficient must be in (0, 1].")
