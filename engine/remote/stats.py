"""A remote engine's telemetry as the protocol's `Stats` event, with the remote's record in
`Stats.extra["remote"]` (`RemoteStats` as a dict; `remote_stats(stats)` reads it back typed).

What the client measures itself (`ttft_ms`, `tokens_per_s`, `tpot_ms` of the reply streaming or
the last one) fills both the record and the `Stats` fields of the same names; the remote's
`/metrics` fills `RemoteStats.metrics` (`engine.remote.metrics`) and `Stats.accept_len`. The
fields only the local engine knows (VRAM, the link, expert cache hits, prefetch, cutoff layer)
are None — `h2d_bytes`, `hits` and `misses`, typed int, are 0 because nothing is copied or
cached on this computer; a dashboard that finds `extra["remote"]` shows the remote's panel
instead of them. Host RAM and RSS are this computer's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.remote.endpoint import RemoteEndpoint
from engine.remote.metrics import RemoteMetrics
from engine.worker.protocol import Stats


@dataclass(frozen=True)
class RemoteStats:
    """The remote part of a Stats event; None: not known (never 0 for unknown)."""

    endpoint: str
    base_url: str
    model: str | None
    ttft_ms: float | None = None  # the reply streaming, else the last one: measured here
    tokens_per_s: float | None = None
    tpot_ms: float | None = None
    generated_tokens: int | None = None
    tokens_counted_by: str | None = None  # "usage" (the server's count) or "chunks" (streamed pieces)
    metrics: RemoteMetrics = field(default_factory=RemoteMetrics)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RemoteStats:
        values = dict(data)
        values["metrics"] = RemoteMetrics(**values.get("metrics", {}))
        return cls(**values)


def remote_stats(stats: Stats) -> RemoteStats | None:
    """The remote record of a Stats event; None for the local engine's."""
    data = stats.extra.get("remote")
    return RemoteStats.from_dict(data) if isinstance(data, dict) else None


def remote_stats_event(
    request_id: str,
    *,
    endpoint: RemoteEndpoint,
    model: str | None,
    generating: bool,
    reply: dict[str, Any] | None,
    metrics: RemoteMetrics,
    host_ram: tuple[int, int],
    process_rss: int,
) -> Stats:
    """The Stats event for a remote engine (see the module docstring for what each field holds)."""
    reply = reply or {}
    record = RemoteStats(
        endpoint.name,
        endpoint.base_url,
        model,
        ttft_ms=reply.get("ttft_ms"),
        tokens_per_s=reply.get("tokens_per_s"),
        tpot_ms=reply.get("tpot_ms"),
        generated_tokens=reply.get("generated_tokens"),
        tokens_counted_by=reply.get("tokens_counted_by"),
        metrics=metrics,
    )
    return Stats(
        request_id=request_id,
        time_s=time.monotonic(),
        generating=generating,
        simulated_link=None,
        vram_used_bytes=None,
        vram_total_bytes=None,
        torch_allocated_bytes=None,
        torch_reserved_bytes=None,
        host_ram_used_bytes=host_ram[0],
        host_ram_total_bytes=host_ram[1],
        process_rss_bytes=process_rss,
        h2d_bytes=0,
        h2d_gbps=None,
        pcie_rx_gbps=None,
        pcie_tx_gbps=None,
        hits=0,
        misses=0,
        hit_rate=None,
        hit_rate_total=None,
        hit_rate_by_phase={},
        generated_tokens=reply.get("generated_tokens") or 0,
        tokens_per_s=record.tokens_per_s,
        tpot_ms=record.tpot_ms,
        accept_len=metrics.accept_len,
        prefetch_precision=None,
        prefetch_recall=None,
        cutoff_layer=None,
        cache_slots_used=None,
        cache_slots_total=None,
        extra={"remote": asdict(record)},
    )
