"""The engine's state as the user reads it: one wording for the status bar, the dashboard and Settings.

The window owns the state (`EngineState`) and shows `state_line(...)` in both the
status bar and the dashboard, so the two can never disagree. The simulated
host→device link is named by `SIMULATED_LINK` everywhere (the dashboard's note,
the status bar, a reply's stats line, Settings' help line).
"""

from __future__ import annotations

import enum

SIMULATED_LINK = "simulated link"
SIMULATED_LINK_NOTE = "Simulated link — no GPU: transfer figures are simulated"
SIMULATED_LINK_SETTING = (
    "Without a GPU, experts can cross a simulated link of this speed (to compare cache policies); "
    "none: they are used in place in RAM, nothing is copied."
)
SIMULATED_LINK_UNLIMITED = "none (in place)"  # no link simulated: a CPU uses the experts where they are
IN_PLACE_NOTE = "CPU: experts used in place, nothing copied"


class EngineState(enum.Enum):
    """What the engine is doing, from the user's side."""

    STARTING = "starting"  # the worker process is starting
    LOADING = "loading"  # a model is being loaded
    IDLE = "idle"  # a model is loaded, no reply in flight
    GENERATING = "generating"  # a reply is streaming
    NO_MODEL = "no model"  # the last load failed
    CRASHED = "crashed"  # the worker died
    RESTARTING = "restarting"  # a new worker is starting after a crash or on request

    @property
    def has_model(self) -> bool:
        return self in (EngineState.IDLE, EngineState.GENERATING)


def state_line(state: EngineState, model_name: str = "", detail: str = "") -> str:
    """The one line the status bar and the dashboard show for `state`; `detail` is appended."""
    name = model_name or "the model"
    text = {
        EngineState.STARTING: "Starting the engine…",
        EngineState.LOADING: f"Loading {name}…",
        EngineState.IDLE: f"{name} · ready",
        EngineState.GENERATING: f"{name} · generating",
        EngineState.NO_MODEL: "No model loaded: the last load failed",
        EngineState.CRASHED: "The engine stopped",
        EngineState.RESTARTING: "Restarting the engine…",
    }[state]
    return f"{text} · {detail}" if detail else text
