"""What auto-tune measures, predicts and chooses: frozen dataclasses of plain values.

Torch-free and JSON-able (`dataclasses.asdict`), so the worker protocol can carry a
`TuneResult` and the GUI can plot it. Times are milliseconds, sizes bytes; a field
is None when this machine cannot tell (no GPU, no NVML, no draft model).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Probe:
    """The machine: GPU, link and CPU, as measured (or simulated, and said so)."""

    device_kind: str  # cuda | cpu
    gpu_name: str | None
    gpu_uuid: str | None
    vram_total_bytes: int | None
    vram_free_bytes: int | None
    pcie_gen_max: int | None
    pcie_gen_current: int | None
    pcie_width_max: int | None
    pcie_width_current: int | None
    h2d_gbps: float  # measured pinned host→device bandwidth for expert-sized copies (or the simulated link's)
    h2d_latency_us: float  # fixed cost of one copy
    simulated_link: bool
    cpu_cores: int
    ram_total_bytes: int
    ram_available_bytes: int
    cpu_expert_ms: float | None  # CPU time of one expert for one token (hybrid execution), if measured
    note: str  # e.g. "No GPU: probed the CPU and a simulated link of 16 GB/s"


@dataclass(frozen=True)
class DrafterProfile:
    """One way of drafting for the model, as measured on it: what a draft token costs and how
    often the target accepts one."""

    name: str  # "draft" (a separate draft model), "self" (SS-MoE top-r), "substitute" (SubSpec), "mtp"
    token_ms: float  # one draft token
    acceptance_rate: float  # per-token α (MoESD's model), fitted to the runs at `draft_len`
    draft_len: int  # the fixed draft length the acceptance was measured at
    accept_len: float  # tokens emitted per verify step measured there (bonus included)
    # tokens drafted per step there: fewer than `draft_len` where the confidence stop (`--tau`)
    # ends drafts early; 0: not measured (every draft runs its whole length)
    drafted_len: float = 0.0


@dataclass(frozen=True)
class Profile:
    """The chosen model on this machine."""

    model: str  # folder
    model_type: str
    moe_layers: int
    num_experts: int  # routed experts per layer (E)
    top_k: int  # K
    expert_nbytes: int  # one packed expert
    target_layer_ms: float  # one decode step of one layer, its experts resident
    draft_token_ms: float | None  # one draft token (the whole drafter), None without a drafter
    expert_load_ms: float  # one expert copy host→device
    verify_ms: tuple[float, ...]  # [t-1]: one target forward over t tokens (t = 1…16), experts resident
    non_expert_bytes: int  # resident weights
    kv_bytes_per_token: int
    context_tokens: int  # the context length memory was planned for
    peak_non_expert_bytes: int  # measured peak device memory without the expert cache
    acceptance_rate: float | None  # the drafter's per-token acceptance α (MoESD's model), fitted
    peak_is_estimate: bool = False  # True: peak_non_expert_bytes was computed (CPU device), not measured
    # [t-1]: unique experts per MoE layer that t consecutive generated tokens route to, measured on
    # the calibration text (t = 1…16); None: not measured, MoESD's uniform N(t) is used instead
    unique_experts_measured: tuple[float, ...] | None = None
    # every drafter measured (`draft_token_ms` and `acceptance_rate` are the first one's)
    drafters: tuple[DrafterProfile, ...] = ()


@dataclass(frozen=True)
class CurvePoint:
    """One configuration's TPOT: the median of its runs and their spread (low..high), when measured."""

    cutoff_layer: int  # -1: no prefetch
    draft_len: int
    tpot_ms: float
    drafter: str = ""  # "draft", "self", "substitute", "mtp" (DrafterProfile.name); "" for plain decoding
    tpot_low_ms: float | None = None  # the fastest and slowest run: the error bar
    tpot_high_ms: float | None = None
    runs: int = 1
    # what else the point ran with, "" where it is the default: the prefetch policy ("next-layer";
    # "" is SP-MoE to `cutoff_layer`, or none at −1), the cache policy ("lfu", "mrs"; "" the loaded
    # one) and the CPU's execution of misses ("auto" on a GPU; "" none)
    prefetch: str = ""
    policy: str = ""
    cpu_experts: str = ""


@dataclass(frozen=True)
class Prediction:
    """The papers' models applied to the probe and the profile."""

    cache_experts: int
    cutoff_layer: int
    draft_len: int
    expected_tpot_ms: float
    expected_tokens_per_s: float
    curve: tuple[CurvePoint, ...]  # predicted TPOT per (drafter, cutoff, draft length) considered
    reasons: tuple[str, ...]  # why, in words a user can read
    drafter: str = ""  # the predicted best's drafter; "" for plain decoding


@dataclass(frozen=True)
class TuneChoice:
    cutoff_layer: int
    draft_len: int
    cache_experts: int
    expected_tokens_per_s: float
    drafter: str = ""  # "draft", "self", "substitute", "mtp", or "" (plain decoding)
    certainty: str = ""  # how sure the choice is, in words: against the runner-up and the spread
    prefetch: str = ""  # as `CurvePoint`'s: "" SP-MoE (or none at cutoff −1), "next-layer"
    policy: str = ""  # the cache policy measured fastest; "" the loaded one
    cpu_experts: str = ""  # "auto" where computing misses on the CPU measured faster; "" never
    why: str = ""  # one sentence: why this configuration won


@dataclass(frozen=True)
class TuneResult:
    probe: Probe
    profile: Profile
    prediction: Prediction
    measured: tuple[CurvePoint, ...]
    choice: TuneChoice
    key: str  # what the result is stored under: GPU, model, budget, precision
    reused: bool  # read back from the store, not measured now
