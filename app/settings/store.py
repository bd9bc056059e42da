"""Where the user settings are kept: JSON in the user's config folder, written atomically.

`SettingsStore` keeps `AppSettings` in `<user config dir>/settings.json`
(`MOE_CHAT_CONFIG_DIR` overrides the directory). Loading never fails: a missing
file gives the defaults, an unreadable one the defaults with a warning, an
unknown key is ignored and an invalid value replaced by its default, each with a
warning, kept in `SettingsStore.problems` for the GUI.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import platformdirs

from app.settings.app_settings import AppSettings, SettingsError, check_field
from app.settings.fields import FIELDS

log = logging.getLogger(__name__)

APP_NAME = "MoE Chat"
CONFIG_DIR_ENV = "MOE_CHAT_CONFIG_DIR"
SETTINGS_FILE = "settings.json"
SCHEMA_VERSION = 1


def config_dir() -> Path:
    """Where per-user settings live: $MOE_CHAT_CONFIG_DIR, else the platform's config folder."""
    if override := os.environ.get(CONFIG_DIR_ENV):
        return Path(override)
    return Path(platformdirs.user_config_dir(APP_NAME, appauthor=False))


def write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    """`payload` as JSON in `path`, via a temporary file and `os.replace`: readers see the old
    file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2, sort_keys=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        Path(temp).replace(path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


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
        write_json_atomically(self.path, {"version": SCHEMA_VERSION, **asdict(settings)})

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
                check_field(key, value, check_folders=False)
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
