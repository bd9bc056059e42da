"""The user settings themselves: one frozen, validated model and what it means to the engine.

`AppSettings` holds what the user chooses in the settings dialog: which model
and device, how the expert cache is sized and kept, and how replies are
generated (speculation, prefetch, CPU experts). `validate()` raises a
`SettingsError` naming the offending field (a key of `FIELDS`); it reuses the
engine's own validators by building the `OffloadConfig` and `SpecConfig` the
settings stand for. `needs_reload` says when a change means loading the model
again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app.settings.fields import FIELDS, RELOAD_FIELDS, FieldInfo
from engine.config import ExpertBudget, OffloadConfig
from engine.errors import EngineError, InvalidConfigError
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig


class SettingsError(InvalidConfigError):
    """A setting is invalid; `field` names it (a key of `FIELDS`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{FIELDS[field].title}: {message}")
        self.field = field
        self.reason = message


# words of OffloadConfig.validate's messages → the field they are about
_OFFLOAD_WORDS = (("expert_dtype", "expert dtype"), ("policy", "policy"), ("sim_link_gbps", "link"))


@dataclass(frozen=True)
class AppSettings:
    """What the user chose; the defaults show the product: the demo model, speculation with the
    model's drafter and SP-MoE prefetch (`auto`, resolved by the engine for the model loaded)."""

    model_path: str | None = None  # None: the bundled demo model
    device: str = "auto"
    expert_budget: str = "auto"
    spec_mode: str = "auto"
    draft_model: str | None = None
    draft_len: int = 4
    prefetch: str = "auto"
    cpu_experts: str = "never"
    expert_dtype: str = "native"
    kv_dtype: str = "auto"  # the KV cache's storage precision (auto: the compute dtype)
    kernels: str = "auto"  # on the CPU: llama.cpp's ggml kernels where they run (auto), exact or ggml
    context_length: int | None = None  # tokens a chat may hold; None: the model's window
    policy: str = "lru"
    sim_link_gbps: float | None = None  # only without a GPU
    cutoff_layer: int | None = None  # spmoe: last MoE layer prefetched; None: automatic, -1: no prefetch

    def validate(self, check_folders: bool = False) -> None:
        """Raise `SettingsError` naming the first invalid field; `check_folders` also requires
        the model and draft folders to exist (the dialog does; a stored setting need not)."""
        for name in FIELDS:
            check_field(name, getattr(self, name), check_folders)
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
            kv_dtype=self.kv_dtype,
            context_length=self.context_length,
            kernels=self.kernels,
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

    def tune_blockers(self) -> dict[str, str]:
        """The settings that fix, for every model, what a tune chooses per model: {field: its
        value}. A stored tune result runs as a model's `auto` (engine.worker.tuned), so it runs
        only where speculation and prefetch are `auto` and no cutoff layer is set."""
        fixed = {name: str(getattr(self, name)) for name in ("spec_mode", "prefetch")}
        fixed = {name: value for name, value in fixed.items() if value != "auto"}
        if self.cutoff_layer is not None:
            fixed["cutoff_layer"] = str(self.cutoff_layer)
        return fixed

    def with_tune(self) -> AppSettings:
        """These settings with speculation, prefetch and the cutoff left to each model's `auto`, so
        a model's stored tune result runs for it (and other models keep theirs, or the defaults).
        Nothing else changes: a tune never writes a budget, draft length or policy for all models."""
        return replace(self, spec_mode="auto", prefetch="auto", cutoff_layer=None)


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


def check_field(name: str, value: Any, check_folders: bool) -> None:
    """Raise `SettingsError` when `value` is not valid for the field `name` on its own."""
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
        shown = (_bound(low, "-inf"), _bound(high, "inf"))
        raise SettingsError(name, "must be between {} and {}, got {}.".format(*shown, value))


def _bound(value: float | None, unbounded: str) -> str:
    """A field's bound as the user reads it: 10,485,760 rather than 1.04858e+07."""
    if value is None:
        return unbounded
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:g}"
