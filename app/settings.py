"""The app's user settings: one validated, frozen model, its field metadata, and its JSON store.

`AppSettings` holds what the user chooses in the settings dialog: which model
and device, how the expert cache is sized and kept, and how replies are
generated (speculation, prefetch, CPU experts). `validate()` raises a
`SettingsError` naming the offending field; it reuses the engine's own
validators by building the `OffloadConfig` and `SpecConfig` the settings stand
for. `FIELDS` gives each field a title, a short summary, an explanation and its
choices or bounds (napari-style), and the dialog is built from it.

`SettingsStore` keeps the settings as JSON in `<user config dir>/settings.json`
(`MOE_CHAT_CONFIG_DIR` overrides the directory), written atomically. Loading
never fails: a missing file gives the defaults, an unreadable one the defaults
with a warning, an unknown key is ignored and an invalid value replaced by its
default, each with a warning, kept in `SettingsStore.problems` for the GUI.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import platformdirs

from engine.config import DEVICES, EXPERT_DTYPES, ExpertBudget, OffloadConfig
from engine.errors import EngineError, InvalidConfigError
from engine.generation_config import (
    CPU_EXPERT_MODES,
    PREFETCH_POLICIES,
    SPEC_MODES,
    GenerationConfig,
    SamplingConfig,
    SpecConfig,
)
from engine.offload.eviction import POLICIES

log = logging.getLogger(__name__)

APP_NAME = "MoE Chat"
CONFIG_DIR_ENV = "MOE_CHAT_CONFIG_DIR"
SETTINGS_FILE = "settings.json"
SCHEMA_VERSION = 1
MAX_DRAFT_LEN = SpecConfig().max_draft_len
MAX_SIM_LINK_GBPS = 1000.0
MAX_CUTOFF_LAYER = 1000  # no model has this many MoE layers; the engine clamps to its own


class SettingsError(InvalidConfigError):
    """A setting is invalid; `field` names it (a key of `FIELDS`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{FIELDS[field].title}: {message}")
        self.field = field
        self.reason = message


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
        "off: one token per forward pass. draft: a small model with the same tokenizer drafts. self: the "
        "model drafts with fewer experts per token (SS-MoE). substitute: low-bit copies of the experts, "
        "resident on the GPU, draft (SubSpec). Verification is lossless in every mode.",
        "choice",
        _choices(SPEC_MODES, {"none": "off", "self": "self (fewer experts)", "substitute": "substitute"}),
    ),
    "draft_model": FieldInfo(
        "Draft model folder",
        "For draft mode: a small model sharing the tokenizer; empty uses the demo's draft.",
        "The folder of a small dense or MoE model with the same tokenizer as the main model. It is only "
        "used when speculative decoding is 'draft'. With the demo model it may be left empty.",
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
        "none: copy an expert when it is needed. next-layer: the next layer's router guesses ahead. "
        "hybrimoe: prefetch the next 3 layers by impact. spmoe: while the draft runs, predict the experts "
        "verification will need and copy them in the background, and during verification copy the next "
        "layer's likely experts while the current one finishes (SP-MoE; needs speculative decoding).",
        "choice", _choices(PREFETCH_POLICIES, {"none": "none", "spmoe": "spmoe (from the draft)"}),
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
# words of OffloadConfig.validate's messages → the field they are about
_OFFLOAD_WORDS = (("expert_dtype", "expert dtype"), ("policy", "policy"), ("sim_link_gbps", "link"))


@dataclass(frozen=True)
class AppSettings:
    """What the user chose; the defaults are the engine's (demo model, lossless, no prefetch)."""

    model_path: str | None = None  # None: the bundled demo model
    device: str = "auto"
    expert_budget: str = "auto"
    spec_mode: str = "none"
    draft_model: str | None = None
    draft_len: int = 4
    prefetch: str = "none"
    cpu_experts: str = "never"
    expert_dtype: str = "native"
    policy: str = "lru"
    sim_link_gbps: float | None = None  # only without a GPU
    cutoff_layer: int | None = None  # spmoe: last MoE layer prefetched; None: automatic, -1: no prefetch

    def validate(self, check_folders: bool = False) -> None:
        """Raise `SettingsError` naming the first invalid field; `check_folders` also requires
        the model and draft folders to exist (the dialog does; a stored setting need not)."""
        for name in FIELDS:
            _check_field(name, getattr(self, name), check_folders)
        offload = self.to_offload_config()
        try:
            offload.validate()
        except EngineError as err:  # the checks above catch these first; name the field all the same
            field = next((f for f, word in _OFFLOAD_WORDS if word in str(err).lower()), "device")
            raise SettingsError(field, str(err)) from err
        if self.spec_mode == "draft" and not self.draft_model and self.model_path is not None:
            raise SettingsError("draft_model", "draft mode needs a draft model folder for this model.")
        if self.prefetch == "spmoe" and self.spec_mode == "none":
            raise SettingsError(
                "prefetch",
                "spmoe predicts experts from the draft: turn speculative decoding on, "
                "or choose another prefetch.",
            )
        try:
            self.to_spec_config().validate()
        except EngineError as err:
            raise SettingsError(
                "draft_model" if self.spec_mode == "draft" else "spec_mode", str(err)
            ) from err

    @staticmethod
    def needs_reload(old: AppSettings, new: AppSettings) -> bool:
        """Whether going from `old` to `new` means loading the model again (see `needs_reload`)."""
        return needs_reload(old, new)

    def to_offload_config(self) -> OffloadConfig:
        """The engine's offload config (raises `SettingsError` for an unreadable expert budget)."""
        try:
            budget = ExpertBudget.parse(self.expert_budget)
        except EngineError as err:
            raise SettingsError("expert_budget", str(err)) from err
        return OffloadConfig(
            device=self.device,
            expert_budget=budget,
            policy=self.policy,
            sim_link_gbps=self.sim_link_gbps,
            expert_dtype=self.expert_dtype,
        )

    def to_spec_config(self) -> SpecConfig:
        """The engine's speculation config; draft mode on the demo model drafts with the demo's draft."""
        draft_model = self.draft_model
        if self.spec_mode == "draft" and not draft_model and self.model_path is None:
            from engine.resources import demo_draft_dir

            draft_model = str(demo_draft_dir())
        return SpecConfig(mode=self.spec_mode, draft_model=draft_model, draft_len=self.draft_len)

    def generation_config(self, sampling: SamplingConfig, max_new_tokens: int) -> GenerationConfig:
        """A generation request's config: the given sampling and length, speculation etc. from here."""
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            spec=self.to_spec_config(),
            prefetch=self.prefetch,
            cpu_experts=self.cpu_experts,
            cutoff=self.cutoff_layer,
        )

    def with_tune(self, choice: dict[str, Any]) -> AppSettings:
        """These settings with an auto-tune choice applied (`engine.tune.types.TuneChoice` as a dict).

        The cache gets `cache_experts` experts; a draft length of 0 means plain decoding (speculation
        and prefetch off), else speculation drafts that many tokens (draft mode where a drafter is
        at hand) and a cutoff of 0 or more turns on the spmoe prefetch up to that layer."""
        draft_len = int(choice["draft_len"])
        cutoff_layer = int(choice["cutoff_layer"])
        changes: dict[str, Any] = {
            "expert_budget": str(int(choice["cache_experts"])),
            "cutoff_layer": cutoff_layer,
        }
        if draft_len <= 0:
            changes.update(spec_mode="none", prefetch="none")
        else:
            spec_mode = self.spec_mode
            if spec_mode == "none" and (self.model_path is None or self.draft_model):
                spec_mode = "draft"
            changes.update(spec_mode=spec_mode, draft_len=max(1, draft_len))
            if cutoff_layer >= 0 and spec_mode != "none":
                changes["prefetch"] = "spmoe"
        return replace(self, **changes)


def needs_reload(old: AppSettings, new: AppSettings) -> bool:
    """Whether going from `old` to `new` means loading the model again (model or offload changed).

    Generation-only fields (speculation, prefetch, CPU experts) apply to the next reply as they are."""
    return _reload_key(old) != _reload_key(new)


def _reload_key(settings: AppSettings) -> tuple:
    try:
        budget: object = ExpertBudget.parse(settings.expert_budget)  # '2GiB' and '2 GiB' are the same
    except EngineError:
        budget = settings.expert_budget
    key = tuple(getattr(settings, name) for name in RELOAD_FIELDS if name != "expert_budget")
    return (*key, budget)


def _check_field(name: str, value: Any, check_folders: bool) -> None:
    info = FIELDS[name]
    if value is None:
        if not info.optional:
            raise SettingsError(name, "a value is required.")
        return
    if info.kind in ("choice", "text", "folder") and not isinstance(value, str):
        raise SettingsError(name, f"expected text, got {value!r}.")
    if info.kind == "choice" and value not in (v for v, _ in info.choices):
        allowed = ", ".join(v for v, _ in info.choices)
        raise SettingsError(name, f"{value!r} is not one of {allowed}.")
    if info.kind == "folder":
        if not value.strip():
            raise SettingsError(name, "the folder name is empty (leave the setting unset instead).")
        if check_folders and not Path(value).expanduser().is_dir():
            raise SettingsError(name, f"there is no folder {value!r}.")
    if info.kind in ("int", "float"):
        _check_number(name, info, value)


def _check_number(name: str, info: FieldInfo, value: Any) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if info.kind == "int" and not is_int:
        raise SettingsError(name, f"expected a whole number, got {value!r}.")
    if not (is_int or isinstance(value, float)) or not math.isfinite(value):
        raise SettingsError(name, f"expected a number, got {value!r}.")
    low, high = info.minimum, info.maximum
    if info.kind == "float" and info.optional and low == 0 and not value > 0:
        raise SettingsError(name, f"must be larger than 0 GB/s (or off), got {value}.")
    if (low is not None and value < low) or (high is not None and value > high):
        raise SettingsError(name, f"must be between {low:g} and {high:g}, got {value}.")


# ---- the store ------------------------------------------------------------------------------------


def config_dir() -> Path:
    """Where per-user settings live: $MOE_CHAT_CONFIG_DIR, else the platform's config folder."""
    if override := os.environ.get(CONFIG_DIR_ENV):
        return Path(override)
    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


class SettingsStore:
    """`AppSettings` as JSON on disk; `load` never raises, `save` replaces the file atomically."""

    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.path = Path(path) if path is not None else config_dir() / SETTINGS_FILE
        self.problems: list[str] = []  # what the last load() had to ignore or reset

    def load(self) -> AppSettings:
        """The stored settings; anything unreadable falls back to its default, with a warning."""
        self.problems = []
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return AppSettings()
        except (OSError, UnicodeDecodeError) as err:
            return self._default_because(f"Cannot read the settings file {self.path} ({err}).")
        try:
            stored = json.loads(text)
        except json.JSONDecodeError as err:
            return self._default_because(f"The settings file {self.path} is not valid JSON ({err}).")
        if not isinstance(stored, dict):
            return self._default_because(f"The settings file {self.path} does not hold a JSON object.")
        return self._merge(stored)

    def save(self, settings: AppSettings) -> None:
        """Write `settings` (validated first) via a temporary file and `os.replace`."""
        settings.validate()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"version": SCHEMA_VERSION, **asdict(settings)}, indent=2, sort_keys=True)
        fd, temp = tempfile.mkstemp(prefix=".settings-", suffix=".json", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(payload + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            Path(temp).replace(self.path)  # atomic: readers see the old file or the new one
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def _merge(self, stored: dict[str, Any]) -> AppSettings:
        known = {f.name for f in fields(AppSettings)}
        values: dict[str, Any] = {}
        for key, value in stored.items():
            if key == "version":
                continue
            if key not in known:
                self._warn(f"Ignoring unknown setting {key!r} in {self.path}.")
                continue
            try:
                _check_field(key, value, check_folders=False)
            except SettingsError as err:
                self._warn(f"{err} Using the default instead.")
                continue
            values[key] = value
        settings = AppSettings(**values)
        for _ in FIELDS:  # settings that are fine alone but not together: reset the one named
            try:
                settings.validate()
                return settings
            except SettingsError as err:
                self._warn(f"{err} Using the default instead.")
                settings = replace(settings, **{err.field: getattr(AppSettings(), err.field)})
        return AppSettings()

    def _default_because(self, problem: str) -> AppSettings:
        self._warn(f"{problem} Using the default settings.")
        return AppSettings()

    def _warn(self, problem: str) -> None:
        log.warning("%s", problem)
        self.problems.append(problem)
