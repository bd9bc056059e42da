"""The bench's memory figures: what the process holds against what the model needs.

`peak_rss_bytes` is the process's high-water mark (one model a process); `current_rss_bytes`,
read before the model loads, is the process's own baseline (Python, torch, the tokenizer
library). The model needs its routed experts as stored, its resident weights and a KV cache for
the longest sequence the bench ran: `model_bytes`. The ratio the issue's target names is
(peak − baseline) / model bytes.
"""

from __future__ import annotations

import sys

import psutil

from engine.model.kv_size import KvShape, kv_element_bytes


def peak_rss_bytes() -> int:
    """The peak resident set of this process (Linux and macOS report it in different units)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def kv_cache_bytes(model, tokens: int) -> int:
    """The model's KV cache after `tokens` tokens, as --kv-dtype stores it (auto: the compute dtype)."""
    compute = model.dtype.itemsize if hasattr(model.dtype, "itemsize") else 2
    element = kv_element_bytes(model.config.kv_dtype, compute)
    return KvShape.from_config(model.hf_config.to_dict()).nbytes(tokens, element)


def memory_line(row) -> str | None:
    """'(peak − baseline) / model bytes' for a moe-chat row that measured them, else None."""
    needed = (row.peak_rss_bytes, row.baseline_rss_bytes, row.store_bytes, row.resident_bytes, row.kv_bytes)
    if None in needed:
        return None
    from engine.config import format_bytes

    model = row.store_bytes + row.resident_bytes + row.kv_bytes
    grown = row.peak_rss_bytes - row.baseline_rss_bytes
    return (
        f"memory: peak RSS {format_bytes(row.peak_rss_bytes)} = process baseline "
        f"{format_bytes(row.baseline_rss_bytes)} + {format_bytes(grown)}; the model needs "
        f"{format_bytes(model)} (experts {format_bytes(row.store_bytes)} + resident "
        f"{format_bytes(row.resident_bytes)} + KV {format_bytes(row.kv_bytes)}): "
        f"{grown / model:.2f}x of it"
        + ("" if not row.huge_page_bytes else f"; {format_bytes(row.huge_page_bytes)} on 2 MiB pages")
    )
