"""The bench's rows: one engine's figures for one budget, and the table they print as."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import format_bytes


@dataclass(frozen=True)
class BenchRow:
    engine: str  # "moe-chat" | "transformers"
    budget: str
    cache_slots: int | None
    tpot_ms: float
    tokens_per_s: float
    prefill_tokens_per_s: float | None
    hit_rate: float | None  # decode phase
    h2d_gbps: float | None
    bytes_per_token: float | None
    decode_tokens: int
    simulated_link: bool
    peak_rss_bytes: int | None = None  # this process's peak resident memory so far (run one model a process)
    pinned_bytes: int | None = None  # host memory pinned for the link (the expert store on CUDA)
    store_bytes: int | None = None  # the routed experts in host memory, in their stored precision
    baseline_rss_bytes: int | None = None  # this process before the model loaded (Python, torch)
    resident_bytes: int | None = None  # the model's weights besides the routed experts
    kv_bytes: int | None = None  # the KV cache of the longest sequence run
    in_place: bool = False  # CPU, no link simulated: the experts are used where the store holds them
    copy_hidden: float | None = None  # share of the link's copy time compute did not wait for
    huge_page_bytes: int | None = None  # this process's memory on 2 MiB pages (engine.huge_pages)
    step_path: str | None = None  # the decode-step path most steps took (engine.decode.paths)
    step_paths: dict[str, int] | None = None  # steps per path
    step_path_declined: dict[str, str] | None = None  # why faster paths left steps to slower ones


def format_table(rows: list[BenchRow]) -> str:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    header = f"{'engine':<13}{'budget':<16}{'slots':>6}{'tpot_ms':>10}{'tok/s':>9}{'prefill/s':>11}"
    header += f"{'hit_rate':>10}{'h2d_GB/s':>10}{'bytes/tok':>12}{'hidden':>8}{'peak RSS':>11}{'pinned':>10}"
    header += "  link             step path"
    lines = [header]
    for r in rows:
        link = "simulated" if r.simulated_link else ("real" if r.engine == "moe-chat" else "none")
        link = "none (in place)" if r.in_place else link
        lines.append(
            f"{r.engine:<13}{r.budget:<16}{num(r.cache_slots, 'd'):>6}{r.tpot_ms:>10.2f}"
            f"{r.tokens_per_s:>9.1f}{num(r.prefill_tokens_per_s, '.0f'):>11}{num(r.hit_rate, '.1%'):>10}"
            f"{num(r.h2d_gbps, '.3f'):>10}"
            f"{(format_bytes(r.bytes_per_token) if r.bytes_per_token is not None else '-'):>12}"
            f"{num(r.copy_hidden, '.0%'):>8}"
            f"{size(r.peak_rss_bytes):>11}{size(r.pinned_bytes):>10}  {link:<17}{r.step_path or '-'}"
        )
    return "\n".join(lines)


def step_path_line(row: BenchRow) -> str:
    """The steps each decode-step path ran, and why the faster ones left steps to slower ones."""
    if not row.step_paths:
        return ""
    by_count = sorted(row.step_paths.items(), key=lambda item: -item[1])
    ran = ", ".join(f"{name} {count}" for name, count in by_count)
    declined = "; ".join(f"{name} declined: {why}" for name, why in (row.step_path_declined or {}).items())
    return f"{row.engine} {row.budget} step paths: {ran}" + (f" ({declined})" if declined else "")


def size(nbytes: int | None) -> str:
    return "-" if nbytes is None else format_bytes(nbytes)
