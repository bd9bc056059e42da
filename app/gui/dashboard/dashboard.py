"""The live dashboard: the worker's telemetry as numbers and one-minute sparklines.

Inputs, all from the window: `set_state(state, line)` (the `EngineState` and the
same line the status bar shows), `set_model(info)` (the `Loaded` event's dict,
None: no model), `set_decoding(spec, prefetch)` (the modes the next reply runs
with), `update_stats(stats)` (each `Stats` event, ~4 Hz generating, 1 Hz idle)
and `reply_ended(stats)` (the `Finished` event's stats; None when the reply did
not finish).

Between replies the reply's figures stay, greyed and labelled "last reply",
instead of blanking to n/a the moment a reply ends; memory and the cache stay
live. A figure that does not apply says why ("speculation off", "prefetch off",
"no cutoff") rather than 0 % or -1; a figure the worker does not know is "n/a";
the dashboard never makes a number up. Whenever the link is simulated, a note
says so in the words every other place uses (`engine_state.SIMULATED_LINK_NOTE`).

Repaints are cheap and never re-layout (see `dashboard_parts`); the tiles
re-flow into fewer columns only when the dashboard gets narrow.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from app.gui.dashboard.dashboard_parts import (
    GIB,
    NA,
    TILES,
    MetricTile,
    OccupancyBar,
    StatText,
    fmt_gbps,
    fmt_gib,
    fmt_number,
    fmt_percent,
    fmt_used_total,
    model_summary,
)
from app.gui.dashboard.remote_dashboard import RemotePanel
from app.gui.engine.engine_state import IN_PLACE_NOTE, SIMULATED_LINK_NOTE, EngineState
from engine.config import format_bytes
from engine.remote.stats import remote_stats
from engine.worker.protocol import Stats

__all__ = [
    "NA",
    "SIMULATED_TEXT",
    "Dashboard",
    "fmt_gbps",
    "fmt_used_total",
    "model_summary",
    "reply_figures",
]

log = logging.getLogger(__name__)

SIMULATED_TEXT = SIMULATED_LINK_NOTE
TILE_MIN_WIDTH = 135  # below this per column the tiles re-flow into fewer columns
REPLY_TILES = ("link", "hit_rate", "tokens_per_s", "tpot", "accept_len", "prefetch", "cutoff")
_NOTES = {  # the line under the title when no model is loaded, by state
    EngineState.STARTING: "Figures appear once a model is loaded.",
    EngineState.LOADING: "Figures appear once the model is loaded.",
    EngineState.NO_MODEL: "Load a model to see live figures.",
    EngineState.CRASHED: "The engine process ended; the figures below are the last seen.",
    EngineState.RESTARTING: "A new engine process starts; the model is loaded again.",
}
_TITLES = {  # the dashboard's title when no model is loaded, by state
    EngineState.STARTING: "Starting the engine…",
    EngineState.LOADING: "Loading a model…",
    EngineState.NO_MODEL: "No model loaded",
    EngineState.CRASHED: "The engine stopped",
    EngineState.RESTARTING: "Restarting the engine…",
}


_DRAFTERS = {"draft": "draft model", "self": "self-draft", "substitute": "substitutes"}
_PREFETCHERS = {"spmoe": "SP-MoE", "hybrimoe": "HybriMoE"}


def policy_name(prefetch: str | None) -> str | None:
    """The prefetch policy of a reply's description ("spmoe (cutoff 3 of 4 MoE layers, auto)": spmoe)."""
    return prefetch.split(" ", 1)[0] if isinstance(prefetch, str) else prefetch


def reply_figures(f: dict[str, Any], live: bool, moe_layers: int | None = None) -> dict[str, tuple[str, str]]:
    """The reply tiles' (value, detail) from a reply's figures: a live `Stats` as a dict, or the
    last reply's `GenerationStats` dict (then every detail starts "last reply"). `spec` /
    `prefetch` None: the mode is not known, so the figures are shown as they are."""

    def tag(*parts: str) -> str:
        return " · ".join(p for p in (() if live else ("last reply",)) + parts if p)

    link = []
    if f.get("pcie_rx_gbps") is not None:
        link.append(f"NVML PCIe rx {fmt_gbps(f['pcie_rx_gbps'])}")
    elif f.get("simulated_link"):
        link.append("counted on the simulated link")
    if f.get("h2d_bytes") is not None:
        link.append(f"{format_bytes(f['h2d_bytes'])} copied")
    hits = f"{f['hits']:,} hits / {f['misses']:,} misses" if f.get("hits") or f.get("misses") else ""
    cumulative = f"cumulative {fmt_percent(f.get('hit_rate_total'))}" if live else ""
    tokens = f"{'generating' if live else 'last reply'} · {f.get('generated_tokens') or 0:,} tokens"
    if not live and f.get("prompt_tokens"):  # how much of the prompt a kept KV cache held
        tokens += f" · prompt {f['prompt_tokens']:,}, {f.get('cached_prompt_tokens') or 0:,} reused"
    measuring = live and not f.get("tokens_per_s")  # the reply's first tokens: no rate yet, not 0
    out = {
        "link": (fmt_gbps(f.get("h2d_gbps")), tag(*link)),
        "hit_rate": (fmt_percent(f.get("hit_rate")), tag(cumulative, hits)),
        "tokens_per_s": ("…" if measuring else fmt_number(f.get("tokens_per_s"), "tok/s"), tokens),
        "tpot": ("…" if measuring else fmt_number(f.get("tpot_ms"), "ms"), tag("decode time per token")),
    }
    spec, prefetch = f.get("spec"), policy_name(f.get("prefetch"))
    if spec == "none":
        out["accept_len"] = ("off", "speculation off")
    else:  # the drafter `auto` resolved to, when the engine said
        accept = fmt_number(f.get("accept_len"), "tokens", 2)
        out["accept_len"] = (accept, tag(_DRAFTERS.get(spec, spec or ""), "per verify step, bonus included"))
    if prefetch == "none":
        out["prefetch"] = ("off", "prefetch off")
    elif not f.get("misses") and not f.get("h2d_bytes") and not f.get("prefetch_precision"):
        out["prefetch"] = ("not needed", tag("every expert was already in memory"))
    else:
        recall = f"{fmt_percent(f.get('prefetch_precision'))} / {fmt_percent(f.get('prefetch_recall'))}"
        out["prefetch"] = (recall, tag(_PREFETCHERS.get(prefetch, prefetch or ""), "precision / recall"))
    out["cutoff"] = _cutoff(f.get("cutoff_layer"), prefetch, moe_layers, tag)
    return out


def _cutoff(cutoff: int | None, prefetch: str | None, moe_layers: int | None, tag) -> tuple[str, str]:
    if prefetch == "none":
        return "no cutoff", "prefetch off"
    if prefetch is not None and prefetch != "spmoe":
        return "no cutoff", f"spmoe prefetch only ({prefetch} now)"
    if cutoff is None or cutoff < 0:
        return "no cutoff", "nothing prefetched from the draft"
    of = f" of 0–{moe_layers - 1}" if isinstance(moe_layers, int) and moe_layers > 0 else ""
    return str(cutoff), tag(f"last MoE layer prefetched{of}")


def _live_figures(s: Stats, mode: dict[str, str | None]) -> dict[str, Any]:
    return {
        "h2d_gbps": s.h2d_gbps, "h2d_bytes": s.h2d_bytes, "pcie_rx_gbps": s.pcie_rx_gbps,
        "hit_rate": s.hit_rate, "hit_rate_total": s.hit_rate_total, "hits": s.hits, "misses": s.misses,
        "tokens_per_s": s.tokens_per_s, "tpot_ms": s.tpot_ms, "generated_tokens": s.generated_tokens,
        "accept_len": s.accept_len, "prefetch_precision": s.prefetch_precision,
        "prefetch_recall": s.prefetch_recall, "cutoff_layer": s.cutoff_layer,
        "simulated_link": s.simulated_link,
        # what the engine resolved for this reply (`auto` included), else the modes asked for
        "spec": s.extra.get("spec", mode["spec"]), "prefetch": s.extra.get("prefetch", mode["prefetch"]),
    }  # fmt: skip


class Dashboard(QWidget):
    """Live figures of the engine: memory, link, cache, speed and speculation."""

    def __init__(self, parent: QWidget | None = None, columns: int = 3):
        super().__init__(parent)
        self.state = EngineState.STARTING
        self._model: dict[str, Any] | None = None
        self._mode: dict[str, str | None] = {"spec": None, "prefetch": None}  # None: not known
        self._live: dict[str, Any] | None = None  # the reply streaming now, as last seen
        self._last_reply: dict[str, Any] | None = None
        self._reply_model: str | None = None  # the path of the model the last reply came from
        self._last_time: float | None = None
        self._max_columns = columns
        self._columns = 0
        self.title = StatText(self, scale=1.1, bold=True)
        self.summary = StatText(self, muted=True)
        self.status = StatText(self, muted=True)
        self.simulated_label = QLabel(SIMULATED_TEXT, self)
        self.simulated_label.setWordWrap(True)
        self.simulated_label.setStyleSheet(
            "QLabel { background: #fff4e5; color: #6b4100; border: 1px solid #e8a317;"
            " border-radius: 3px; padding: 4px 6px; font-weight: bold; }"
        )
        self.simulated_label.setToolTip(
            "This machine has no GPU: the engine runs on the CPU and copies experts over a simulated "
            "host→device link (see Settings). Link speeds and hit-rate effects are those of the simulation."
        )
        self.simulated_label.hide()
        self.tiles = {
            spec.key: MetricTile(spec.title, spec.tooltip, spec.fixed_max, spec.plot) for spec in TILES
        }
        self.cache_title = StatText(self, scale=0.9, muted=True)
        self.cache_title.setText("Expert cache occupancy")
        self.cache_bar = OccupancyBar(self)
        self.cache_bar.setToolTip("Device cache slots holding an expert / all slots.")
        self.remote_panel = RemotePanel(self)  # instead of the local tiles while a remote answers
        self._build_layout(columns)
        self.set_model(None)

    def _build_layout(self, columns: int) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.setSpacing(6)
        for widget in (self.title, self.summary, self.status, self.simulated_label):
            layout.addWidget(widget)
        self._grid = QGridLayout()
        self._grid.setSpacing(6)
        self._reflow(columns)
        layout.addLayout(self._grid)
        layout.addWidget(self.cache_title)
        layout.addWidget(self.cache_bar)
        layout.addWidget(self.remote_panel)
        layout.addStretch(1)

    def _reflow(self, columns: int) -> None:
        """Lay the tiles out in `columns` columns (only when that number changes)."""
        if columns == self._columns:
            return
        for tile in self.tiles.values():
            self._grid.removeWidget(tile)
        for index, tile in enumerate(self.tiles.values()):
            self._grid.addWidget(tile, index // columns, index % columns)
        for column in range(max(columns, self._columns)):
            self._grid.setColumnStretch(column, 1 if column < columns else 0)
        self._columns = columns
        # fewer columns need more height: say so, or a scroll area keeps the old height and the
        # tiles' lines are drawn over one another
        self.updateGeometry()

    def resizeEvent(self, event: QResizeEvent) -> None:
        fit = max(1, (event.size().width() - 16) // TILE_MIN_WIDTH)
        self._reflow(min(self._max_columns, fit))
        super().resizeEvent(event)

    # -- inputs ---------------------------------------------------------------------------------

    def set_state(self, state: EngineState, line: str) -> None:
        """The engine's state and the line the status bar shows for it."""
        self.state = state
        self.status.setText(line)
        self.status.setToolTip(line)
        self._show_title()
        stopped = state in (EngineState.CRASHED, EngineState.RESTARTING)
        for key in ("vram", "host_ram"):
            self.tiles[key].value.set_muted(stopped)
        if not state.has_model and self._live is not None:
            self.reply_ended(None)  # the engine stopped mid-reply: what was seen of it stays
        else:
            self._show_reply()

    def set_model(self, info: dict[str, Any] | None) -> None:
        """The loaded model (the `Loaded` event's dict), or None when no model is loaded."""
        self._model = info
        for tile in self.tiles.values():
            if tile.sparkline is not None:
                tile.sparkline.clear()
        if info is not None and info.get("path") != self._reply_model:
            self._last_reply = None  # another model: the last reply's figures were not its
            self._reply_model = info.get("path")
        if info is not None and not self.state.has_model:
            self.state = EngineState.IDLE
        self._show_title()
        self._show_remote(bool(info and info.get("remote")))
        self._set_simulated(bool(info and info.get("simulated_link")))
        if info is None:
            self._show_empty()
        self._show_reply()  # the last reply's figures stay while another model (or the same) loads

    def set_decoding(self, spec: str | None, prefetch: str | None) -> None:
        """The speculation and prefetch modes replies run with now (None or "auto": not known)."""
        known = {"spec": spec, "prefetch": prefetch}
        # "auto": the engine picks per model; the reply's own figures will say what it chose
        self._mode = {key: None if value == "auto" else value for key, value in known.items()}
        if self._live is None:
            self._show_reply()

    def reply_ended(self, stats: dict[str, Any] | None) -> None:
        """A reply ended: its figures (a `GenerationStats` dict) stay as "last reply"; None (no
        `Finished`, e.g. a crash) keeps what was last seen of it."""
        seen, self._live = self._live, None
        if stats is not None:
            stats = {**stats, "prefetch": policy_name(stats.get("prefetch"))}
            self._last_reply = {"cutoff_layer": (seen or {}).get("cutoff_layer"), **stats}
        elif seen is not None:  # its interval rates stand; the counts since the load were not its own
            cumulative = ("h2d_bytes", "hits", "misses", "hit_rate_total")
            self._last_reply = {key: value for key, value in seen.items() if key not in cumulative}
        self._show_reply()

    def update_stats(self, stats: Stats) -> None:
        """Show one telemetry sample; cheap enough for every `Stats` event (no re-layout)."""
        if self._last_time is not None and stats.time_s < self._last_time:  # a new worker, a new clock
            for tile in self.tiles.values():
                if tile.sparkline is not None:
                    tile.sparkline.clear()
        self._last_time = stats.time_s
        remote = remote_stats(stats)
        if remote is not None:  # a remote engine: its own panel, none of the local tiles
            self.remote_panel.show_stats(remote, stats.time_s)
            return
        if stats.simulated_link is not None:
            self._set_simulated(stats.simulated_link)
        self._show_memory(stats)
        self.cache_bar.set_slots(stats.cache_slots_used, stats.cache_slots_total)
        self.tiles["link"].title.setText(
            "Host → device (simulated)" if stats.simulated_link else "Host → device"
        )
        if stats.generating and self._model is not None and self.state.has_model:
            self._live = _live_figures(stats, self._mode)
            self._show_reply()
            self._plot_reply(stats)
        elif self._live is not None and not stats.generating:
            self.reply_ended(None)  # the engine is idle although no reply end was heard

    # -- showing --------------------------------------------------------------------------------

    def _show_title(self) -> None:
        """The title and the line under it: the model, or what the engine is doing without one."""
        if self._model is not None and self.state.has_model:
            self.title.setText(self._model.get("name") or Path(str(self._model.get("path") or "model")).name)
            self.summary.setText(model_summary(self._model))
        else:
            self.title.setText(_TITLES.get(self.state, "No model loaded"))
            self.summary.setText(_NOTES.get(self.state, "Load a model to see live figures."))
        self.summary.setToolTip(self.summary.text())

    def _show_reply(self) -> None:
        """The reply tiles: live while a reply streams, else the last reply's, greyed."""
        if self._model is None and self._last_reply is None:
            return
        live = self._live is not None
        figures = self._live if live else self._last_reply
        moe_layers = (self._model or {}).get("moe_layers")
        merged = {**self._mode, **(figures or {})}
        applies = {  # a tile that does not apply says why even before the first reply
            "accept_len": merged["spec"] != "none",
            "prefetch": merged["prefetch"] != "none",
            "cutoff": merged["prefetch"] in (None, "spmoe"),
            "link": not (self._model or {}).get("experts_in_place"),
        }
        for key, (value, detail) in reply_figures(merged, live, moe_layers).items():
            if not applies["link"] and key == "link":  # a CPU with no link simulated copies nothing
                value, detail = "none", IN_PLACE_NOTE
            elif figures is None and applies.get(key, True):
                value, detail = NA, "no reply yet"
            self.tiles[key].show_figures(value, detail, muted=not live)

    def _plot_reply(self, s: Stats) -> None:
        spec_off = self._live["spec"] == "none"
        prefetch_off = self._live["prefetch"] == "none"
        for key, value in (
            ("link", s.h2d_gbps),
            ("hit_rate", s.hit_rate),
            ("tokens_per_s", s.tokens_per_s),
            ("tpot", s.tpot_ms),
            ("accept_len", None if spec_off else s.accept_len),
            ("prefetch", None if prefetch_off else s.prefetch_recall),
        ):  # fmt: skip  (a mode that is off plots nothing, not a line at 0)
            self.tiles[key].sparkline.add(s.time_s, value)

    def _show_memory(self, s: Stats) -> None:
        torch_part = f"torch allocator {fmt_gib(s.torch_allocated_bytes)}"
        if s.torch_reserved_bytes is not None:
            torch_part += f" (reserved {fmt_gib(s.torch_reserved_bytes)})"
        vram = self.tiles["vram"]
        vram.show_figures(fmt_used_total(s.vram_used_bytes, s.vram_total_bytes), torch_part)
        vram.sparkline.fixed_max = s.vram_total_bytes / GIB if s.vram_total_bytes else None
        vram.sparkline.add(s.time_s, _gib_or_none(s.vram_used_bytes))
        ram = self.tiles["host_ram"]
        ram.show_figures(
            fmt_used_total(s.host_ram_used_bytes, s.host_ram_total_bytes),
            f"engine process {fmt_gib(s.process_rss_bytes)}",
        )
        ram.sparkline.fixed_max = s.host_ram_total_bytes / GIB if s.host_ram_total_bytes else None
        ram.sparkline.add(s.time_s, _gib_or_none(s.host_ram_used_bytes))

    def _show_empty(self) -> None:
        for key, tile in self.tiles.items():
            tile.show_figures(NA, "no model loaded" if key in REPLY_TILES else "", muted=key in REPLY_TILES)
        self.tiles["link"].title.setText("Host → device")
        self.cache_bar.set_slots(None, None)

    def _show_remote(self, remote: bool) -> None:
        """The remote panel instead of the local engine's tiles (VRAM, link, expert cache), or back."""
        for widget in (*self.tiles.values(), self.cache_title, self.cache_bar):
            widget.setVisible(not remote)
        self.remote_panel.setVisible(remote)
        if remote:
            self.remote_panel.show_stats(None)

    def _set_simulated(self, simulated: bool) -> None:
        if simulated != self.simulated_label.isVisibleTo(self):
            self.simulated_label.setVisible(simulated)

    def is_simulated_shown(self) -> bool:
        """Whether the simulated-link label is shown (tests; the widget may itself be hidden)."""
        return self.simulated_label.isVisibleTo(self)


def _gib_or_none(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / GIB
