"""What each user setting is, as the settings dialog shows it and validation checks it.

`FIELDS` gives each field of `AppSettings` a title, a short summary, an
explanation and its choices or bounds (napari-style); the dialog is built from
it and `app.settings.app_settings` checks values against it. The choices are the
engine's own tuples, so a new engine option shows up here by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import DEVICES, EXPERT_DTYPES, KERNELS, KV_DTYPES
from engine.device_cache.eviction import POLICIES
from engine.generation_config import CPU_EXPERT_MODES, PREFETCH_CHOICES, SPEC_CHOICES, SpecConfig
from engine.ggml import library as ggml_library

MAX_DRAFT_LEN = SpecConfig().max_draft_len
MAX_SIM_LINK_GBPS = 1000.0
MAX_CUTOFF_LAYER = 1000  # no model has this many MoE layers; the engine clamps to its own
MAX_CONTEXT_LENGTH = 10_485_760  # past every published window; the model's own caps it


@dataclass(frozen=True)
class FieldInfo:
    """How a setting is shown and checked: `kind` is choice, int, float, text or folder."""

    title: str
    summary: str  # one short line shown under the editor
    help: str  # the full explanation (tooltip)
    kind: str
    choices: tuple[tuple[str, str], ...] = ()  # (value, label)
    minimum: float | None = None
    maximum: float | None = None
    optional: bool = False  # None allowed (an empty folder, "off" for a number)
    placeholder: str = ""
    reload: bool = False  # changing it means the model must be loaded again


def _choices(values: tuple[str, ...], labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((value, labels.get(value, value)) for value in values)


KERNEL_LABELS = {"auto": "auto (ggml where it runs)", "exact": "exact", "ggml": "ggml (llama.cpp's)"}


def _offered_kernels() -> tuple[str, ...]:
    """The kernels that can run here: ggml only where its libraries are installed for this CPU."""
    runs, _ = ggml_library.installed()
    return tuple(k for k in KERNELS if runs or k != "ggml")


FIELDS: dict[str, FieldInfo] = {
    "model_path": FieldInfo(
        "Model folder",
        "A Hugging Face model folder; empty runs the bundled demo model.",
        "The folder of a supported MoE model (config.json and *.safetensors). Leave it empty to chat "
        "with the small demo model shipped with the app, which needs no download and no GPU.",
        "folder", optional=True, placeholder="bundled demo model", reload=True,
    ),
    "device": FieldInfo(
        "Device",
        "Where the model runs; auto picks the GPU when there is one.",
        "auto: the first CUDA GPU if there is one, else the CPU. cuda: require a GPU. cpu: run on the CPU "
        "even with a GPU (slow; useful to compare).",
        "choice", _choices(DEVICES, {"auto": "auto (GPU when present)"}), reload=True,
    ),
    "expert_budget": FieldInfo(
        "Expert cache budget",
        "Device memory for cached experts: auto, all, a size (2GiB) or a count (64).",
        "How much device memory holds routed experts. auto: what is left after the resident weights and "
        "a headroom for activations; all: every expert (no offloading); a size such as 2GiB or 512MB; "
        "or a number of experts such as 64. A larger cache means fewer copies over the link.",
        "text", placeholder="auto", reload=True,
    ),
    "expert_dtype": FieldInfo(
        "Expert precision",
        "native keeps the checkpoint's precision; int8/int4 copy fewer bytes but change outputs.",
        "Precision of the routed experts in host memory. int8 and int4 (group-wise) quantize them so each "
        "copy to the GPU moves fewer bytes and more experts fit in the cache, at some cost in quality: the "
        "replies are no longer exactly the model's.",
        "choice", _choices(EXPERT_DTYPES, {"native": "native (exact)"}), reload=True,
    ),
    "kernels": FieldInfo(
        "CPU kernels",
        "auto: llama.cpp's fast kernels where they run; exact: replies are the dequantized model's own.",
        "How the model's weights are computed on the CPU. ggml runs llama.cpp's own kernels on a GGUF "
        "file's blocks and on BF16, F16, MXFP4 and symmetric GPTQ int4 models (an x86-64 CPU needs "
        "AVX2): faster and lighter on RAM, with llama.cpp's numerics (a GGUF's activations rounded to 8 "
        "bits), as llama.cpp's own replies are. exact computes as transformers would, so replies equal "
        "the dequantized model's, more slowly; FP8, AWQ and asymmetric int4 models always run on it. "
        "auto (the default) is ggml wherever it can run, else exact. Only the kernels that can run here "
        "are offered.",
        "choice", _choices(_offered_kernels(), KERNEL_LABELS), reload=True,
    ),
    "kv_dtype": FieldInfo(
        "KV cache precision",
        "auto stores the conversation's keys and values like the model computes; smaller leaves more room.",
        "The KV cache holds every token of the conversation. bfloat16/float16 halve a float32 cache; "
        "float8 (e4m3, one scale per head) quarters it at a small cost in accuracy. On a GPU the room saved "
        "goes to the expert cache.",
        "choice", _choices(KV_DTYPES, {"auto": "auto (the compute dtype)", "float8_e4m3fn": "float8"}),
        reload=True,
    ),
    "context_length": FieldInfo(
        "Context length",
        "Tokens a chat may hold (prompt and reply); empty: the model's own window.",
        "A chat longer than this is refused with the offer to drop its oldest turns. On a GPU the expert "
        "cache leaves room for a KV cache of this many tokens, so a long chat never runs the GPU out of "
        "memory halfway. Smaller than the model's window leaves more memory for experts.",
        "int", minimum=16, maximum=MAX_CONTEXT_LENGTH, optional=True, placeholder="the model's", reload=True,
    ),
    "policy": FieldInfo(
        "Cache eviction",
        "Which cached expert makes room for a new one.",
        "lru: least recently used. lfu: least frequently used. mrs: HybriMoE's Minus-Recent-Score, a "
        "running average of router scores that keeps experts the router keeps favouring.",
        "choice", _choices(POLICIES, {"lru": "LRU", "lfu": "LFU", "mrs": "MRS (HybriMoE)"}), reload=True,
    ),
    "sim_link_gbps": FieldInfo(
        "Simulated link (GB/s)",
        "Without a GPU only: bandwidth of a pretend host→device link (off: no limit).",
        "On a machine without a GPU the engine runs on the CPU and copies experts over a simulated link, "
        "so the offloading policies behave and can be compared as on a GPU. This sets that link's "
        "bandwidth in GB/s (e.g. 16 for PCIe 4.0 x8). Figures measured this way are labelled simulated. "
        "With a GPU the real PCIe link is used and this setting is ignored.",
        "float", minimum=0.0, maximum=MAX_SIM_LINK_GBPS, optional=True, placeholder="off", reload=True,
    ),
    "spec_mode": FieldInfo(
        "Speculative decoding",
        "Draft several tokens cheaply, verify them in one pass; replies stay the same.",
        "auto: the model's own drafter: its multi-token-prediction layer (mtp) or draft model where it has "
        "one (the demo has a draft model), else self. off: one token "
        "per forward pass. draft: a small model with the same tokenizer drafts. self: the model drafts "
        "with fewer experts per token (SS-MoE). substitute: low-bit copies of the experts, resident on "
        "the GPU, draft (SubSpec). mtp: the checkpoint's own MTP layer drafts from the model's hidden "
        "states (Qwen3.5/3.6, DeepSeek-V3, GLM-4.5). Verification is lossless in every mode.",
        "choice",
        _choices(
            SPEC_CHOICES,
            {
                "auto": "auto (the model's drafter)",
                "none": "off",
                "self": "self (fewer experts)",
                "substitute": "substitute",
                "mtp": "mtp (the model's MTP layer)",
            },
        ),
    ),
    "draft_model": FieldInfo(
        "Draft model folder",
        "For draft and auto modes: a small model sharing the tokenizer; empty uses the model's own draft.",
        "The folder of a small dense or MoE model with the same tokenizer as the main model. It is "
        "used when speculative decoding is 'draft', or 'auto' (which otherwise drafts with the model's "
        "bundled draft, or the model itself). With the demo model it may be left empty.",
        "folder", optional=True, placeholder="none",
    ),
    "draft_len": FieldInfo(
        "Draft length",
        "Tokens drafted per verify step (the start value; it adapts to the acceptance seen).",
        "How many tokens the drafter proposes before the model verifies them in one pass. Longer drafts "
        "pay off when most drafts are accepted; the engine adapts it as it goes.",
        "int", minimum=1, maximum=MAX_DRAFT_LEN,
    ),
    "prefetch": FieldInfo(
        "Expert prefetch",
        "Copy experts before they are needed; spmoe predicts them from the draft.",
        "auto: spmoe while speculating, else none. none: copy an expert when it is needed. "
        "next-layer: the next layer's router guesses ahead. "
        "hybrimoe: prefetch the next 3 layers by impact. spmoe: while the draft runs, predict the experts "
        "verification will need and copy them in the background, and during verification copy the next "
        "layer's likely experts while the current one finishes (SP-MoE; needs speculative decoding).",
        "choice",
        _choices(
            PREFETCH_CHOICES,
            {"auto": "auto (spmoe when speculating)", "none": "none", "spmoe": "spmoe (from the draft)"},
        ),
    ),
    "cutoff_layer": FieldInfo(
        "Prefetch cutoff layer",
        "For spmoe: the last MoE layer prefetched from the draft (auto: the engine picks; -1: none).",
        "SP-MoE prefetches the experts of the first layers only, up to this cutoff layer (0-based, "
        "counting MoE layers), so that the copies finish while the draft still runs. auto lets the "
        "engine choose; -1 prefetches nothing. The auto-tune wizard measures the best value for this "
        "machine. It matters only with the spmoe prefetch.",
        "int", minimum=-1, maximum=MAX_CUTOFF_LAYER, optional=True, placeholder="auto",
    ),
    "cpu_experts": FieldInfo(
        "Experts on the CPU",
        "Compute a missing expert on the CPU when that is sooner than copying it (GPU only).",
        "auto: the engine's measured cost model decides per expert. never: always copy to the GPU. "
        "always: compute every missing expert on the CPU (HybriMoE / Fiddler).",
        "choice", _choices(CPU_EXPERT_MODES, {}),
    ),
}  # fmt: skip

RELOAD_FIELDS = tuple(name for name, info in FIELDS.items() if info.reload)
