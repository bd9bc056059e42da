"""A remote engine's own telemetry, read from its Prometheus `/metrics` into `RemoteMetrics`.

vLLM serves `/metrics` always; SGLang with `--enable-metrics`; llama-cpp-python's server and
MoE Chat's do not (every field then stays None). The text is parsed with prometheus-client's
parser, and each field is read from the first of the names below the server exports:

- kv_cache_usage (0–1): vllm:kv_cache_usage_perc (v1) or vllm:gpu_cache_usage_perc (v0);
  sglang:token_usage
- requests_running / requests_waiting: vllm:num_requests_running / vllm:num_requests_waiting;
  sglang:num_running_reqs / sglang:num_queue_reqs
- prefix_cache_hit_rate: vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total;
  sglang:cache_hit_rate
- spec_accept_rate: vllm:spec_decode_num_accepted_tokens_total / vllm:spec_decode_num_draft_tokens_total;
  sglang:spec_accept_rate
- accept_len (tokens per verify step, bonus included): 1 + accepted tokens /
  vllm:spec_decode_num_drafts_total; sglang:spec_accept_length
- ep_balancedness (mean/max expert load over the EP ranks, 1 = even): sglang:eplb_balancedness (a
  summary, exported with SGLANG_ENABLE_EPLB_BALANCEDNESS_METRIC=1); vLLM writes its EPLB
  balancedness to its log (`log_balancedness`), not to /metrics, so it stays None there
- server_tokens_per_s: sglang:gen_throughput (vLLM has only cumulative token counters)

A field the server does not export is None, never 0 (the dashboard shows "n/a"). With several
samples of one name (data-parallel ranks, several models), counts are summed and fractions
averaged. vLLM's counters are cumulative since the server started, so its acceptance figures are
the server's lifetime averages.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

METRICS_TIMEOUT_S = 2.0
MAX_METRICS_BYTES = 8 * 1024**2


@dataclass(frozen=True)
class RemoteMetrics:
    """What the remote's /metrics says; None: not exported by this server (or no /metrics at all)."""

    engine: str | None = None  # "vllm" | "sglang": whose names were found
    kv_cache_usage: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    prefix_cache_hit_rate: float | None = None
    spec_accept_rate: float | None = None
    accept_len: float | None = None  # DESIGN.md's accept_len: tokens per verify step, bonus included
    ep_balancedness: float | None = None
    server_tokens_per_s: float | None = None
    error: str | None = None  # why nothing could be read (no /metrics, unreachable …)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_metrics(text: str) -> RemoteMetrics:
    """The record for a Prometheus exposition text; raises `ValueError` for text that is not one."""
    samples: dict[str, list[float]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append(float(sample.value))

    def total(name: str) -> float | None:
        return sum(samples[name]) if samples.get(name) else None

    def mean(name: str) -> float | None:
        values = samples.get(name)
        return sum(values) / len(values) if values else None

    def first(*values: float | None) -> float | None:
        return next((v for v in values if v is not None), None)

    accepted = total("vllm:spec_decode_num_accepted_tokens_total")
    drafted = total("vllm:spec_decode_num_draft_tokens_total")
    drafts = total("vllm:spec_decode_num_drafts_total")
    hits, queries = total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")
    balance_sum, balance_count = (
        total("sglang:eplb_balancedness_sum"),
        total("sglang:eplb_balancedness_count"),
    )
    engines = {name.split(":", 1)[0] for name in samples if ":" in name}
    return RemoteMetrics(
        engine=next((e for e in ("vllm", "sglang") if e in engines), None),
        kv_cache_usage=first(
            mean("vllm:kv_cache_usage_perc"), mean("vllm:gpu_cache_usage_perc"), mean("sglang:token_usage")
        ),
        requests_running=first(total("vllm:num_requests_running"), total("sglang:num_running_reqs")),
        requests_waiting=first(total("vllm:num_requests_waiting"), total("sglang:num_queue_reqs")),
        prefix_cache_hit_rate=first(_ratio(hits, queries), mean("sglang:cache_hit_rate")),
        spec_accept_rate=first(_ratio(accepted, drafted), mean("sglang:spec_accept_rate")),
        accept_len=first(
            None if accepted is None or not drafts else 1 + accepted / drafts,
            mean("sglang:spec_accept_length"),
        ),
        ep_balancedness=_ratio(balance_sum, balance_count),
        server_tokens_per_s=total("sglang:gen_throughput"),
    )


def _ratio(part: float | None, whole: float | None) -> float | None:
    """part / whole; None when either is missing or nothing was counted yet (0/0 is not 0)."""
    return None if part is None or not whole else part / whole


def fetch_metrics(
    url: str, api_key: str | None = None, timeout_s: float = METRICS_TIMEOUT_S
) -> RemoteMetrics:
    """GET `url` and parse it; never raises: a failure is a record of Nones with `error` set."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(
            request, timeout=timeout_s
        ) as response:  # RemoteEndpoint allows http(s) only
            text = response.read(MAX_METRICS_BYTES).decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        reason = "this server exports no /metrics" if err.code == 404 else f"HTTP {err.code}"
        return RemoteMetrics(error=f"{url}: {reason}")
    except (OSError, ValueError) as err:  # URLError, timeouts, a reset connection
        return RemoteMetrics(error=f"{url}: {err}")
    try:
        return parse_metrics(text)
    except (ValueError, TypeError, IndexError) as err:  # the parser's failures on a non-Prometheus text
        log.debug("Unreadable /metrics from %s: %s", url, err)
        return RemoteMetrics(error=f"{url} is not a Prometheus exposition ({err})")
