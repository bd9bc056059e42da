"""The dashboard's panel for a remote engine: what this app measures and what the server exports.

Measured here, on the streamed reply: time to first token, tokens/s and time per token. From the
server's Prometheus `/metrics` (`engine.remote.metrics`: vLLM always, SGLang with
`--enable-metrics`): KV-cache usage, running / waiting requests, speculative acceptance,
expert-parallel balance, prefix-cache hits and the server's own generation throughput. A figure the
server does not export says "n/a — not exported by this server", never 0; when /metrics cannot be
read at all, the line under the title says why. The local engine's tiles (VRAM, link, expert
cache) do not apply to a remote and are hidden while one is in use.
"""

from __future__ import annotations

from PySide6.QtWidgets import QGridLayout, QWidget

from app.gui.dashboard.dashboard_parts import NA, MetricTile, StatText, fmt_number, fmt_percent
from engine.remote.stats import RemoteStats

NOT_EXPORTED = "not exported by this server"
PLOTTED = ("ttft", "tokens_per_s", "kv_cache")

REMOTE_TILES = (
    ("ttft", "Time to first token", "Measured here: from sending the request to the first streamed piece."),
    ("tokens_per_s", "Tokens/s", "Measured here: 1000 / time per token after the first (decode only)."),
    ("kv_cache", "KV cache", "The server's KV-cache usage (vLLM kv_cache_usage_perc, SGLang token_usage)."),
    ("requests", "Requests", "Requests the server runs now / has waiting in its queue."),
    ("accept", "Speculative acceptance", "Tokens per verify step (bonus included) and the share of drafted "
     "tokens accepted, from the server's counters (vLLM: since it started)."),
    ("ep_balance", "Expert-parallel balance", "Mean / max expert load over the EP ranks (1 = even); SGLang "
     "exports it with SGLANG_ENABLE_EPLB_BALANCEDNESS_METRIC=1, vLLM only logs it."),
    ("prefix", "Prefix cache hits", "Prompt tokens the server found in its prefix cache / looked up."),
    ("server_speed", "Server throughput", "The server's own generation throughput, all requests (SGLang)."),
)  # fmt: skip


class RemotePanel(QWidget):
    """The remote engine's figures as tiles (shown by the Dashboard instead of the local ones)."""

    def __init__(self, parent: QWidget | None = None, columns: int = 2):
        super().__init__(parent)
        self.source = StatText(self, muted=True)
        self.tiles = {
            key: MetricTile(title, tooltip, 1.0 if key == "kv_cache" else None, plot=key in PLOTTED)
            for key, title, tooltip in REMOTE_TILES
        }
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setSpacing(6)
        grid.addWidget(self.source, 0, 0, 1, columns)
        for index, tile in enumerate(self.tiles.values()):
            grid.addWidget(tile, 1 + index // columns, index % columns)
        self.show_stats(None)

    def show_stats(self, remote: RemoteStats | None, time_s: float | None = None) -> None:
        """Show one sample (None: nothing heard from the remote yet)."""
        if remote is None:
            self.source.setText("Waiting for the remote engine's first figures.")
            for tile in self.tiles.values():
                tile.show_figures(NA, "", muted=True)
            return
        m = remote.metrics
        where = f"/metrics of a {m.engine} server" if m.engine else "its /metrics"
        self.source.setText(
            f"Measured here; the server's figures from {where}."
            if m.error is None
            else f"Measured here only: the server's /metrics cannot be read ({m.error})."
        )
        count = remote.generated_tokens
        reply = f"{count:,} token{'s' if count != 1 else ''}" if count else "no reply yet"
        requests = NA
        if m.requests_running is not None or m.requests_waiting is not None:
            requests = f"{_count(m.requests_running)} / {_count(m.requests_waiting)}"
        accept_len = fmt_number(m.accept_len, "tokens", 2)
        figures = {  # fmt_* give n/a for None
            "ttft": (fmt_number(remote.ttft_ms, "ms", 0), reply),
            "tokens_per_s": (
                fmt_number(remote.tokens_per_s, "tok/s"),
                f"time per token {fmt_number(remote.tpot_ms, 'ms')}",
            ),
            "kv_cache": (fmt_percent(m.kv_cache_usage), "used"),
            "requests": (requests, "running / waiting"),
            "accept": (
                accept_len if accept_len != NA else fmt_percent(m.spec_accept_rate),
                _accept_detail(m.spec_accept_rate, accept_len != NA),
            ),
            "ep_balance": (fmt_number(m.ep_balancedness, "", 2), "mean / max load"),
            "prefix": (fmt_percent(m.prefix_cache_hit_rate), "of looked-up tokens"),
            "server_speed": (fmt_number(m.server_tokens_per_s, "tok/s"), "all requests"),
        }
        local = ("ttft", "tokens_per_s")  # measured here: n/a means "no reply yet", not "not exported"
        for key, (value, detail) in figures.items():
            if value == NA:
                value, detail = NA, ("no reply yet" if key in local else NOT_EXPORTED)
            self.tiles[key].show_figures(value, detail, muted=value == NA)
        if time_s is not None:
            plotted = (remote.ttft_ms, remote.tokens_per_s, m.kv_cache_usage)
            for key, value in zip(PLOTTED, plotted, strict=True):
                self.tiles[key].sparkline.add(time_s, value)

    def text(self, key: str) -> str:
        """A tile's value as shown (tests)."""
        return self.tiles[key].value.text()


def _count(value: float | None) -> str:
    return NA if value is None else f"{value:,.0f}"


def _accept_detail(rate: float | None, accept_len: bool) -> str:
    parts = ["per verify step, bonus included"] if accept_len else []
    if rate is not None:
        parts.append(f"{fmt_percent(rate)} of drafted tokens accepted")
    return " · ".join(parts)
