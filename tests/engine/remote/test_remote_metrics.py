"""The remote's Prometheus /metrics fill `RemoteMetrics` from vLLM's and SGLang's own names, and
what a server does not export stays None (never 0)."""

from dataclasses import fields

import pytest

from engine.remote import RemoteEndpoint, RemoteMetrics, fetch_metrics, parse_metrics
from tests.engine.remote.fake_openai import FakeOpenAI, full_reply

# vLLM v1's exposition format: gauges per engine (data-parallel rank), counters with _total and _created
VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 3.0
vllm:num_requests_running{engine="1",model_name="deepseek-ai/DeepSeek-V3"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 4.0
vllm:num_requests_waiting{engine="1",model_name="deepseek-ai/DeepSeek-V3"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="deepseek-ai/DeepSeek-V3"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 250.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 100.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 300.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 180.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 5000.0
vllm:generation_tokens_created{engine="0",model_name="deepseek-ai/DeepSeek-V3"} 1.7e9
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen3-235B-A22B",tp_rank="0"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen3-235B-A22B",tp_rank="0"} 1.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen3-235B-A22B",tp_rank="0"} 0.28
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="Qwen/Qwen3-235B-A22B",tp_rank="0"} 0.0075
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="Qwen/Qwen3-235B-A22B",tp_rank="0"} 812.5
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="Qwen/Qwen3-235B-A22B",tp_rank="0"} 2.6
# HELP sglang:eplb_balancedness Balancedness of MoE in expert parallelism.
# TYPE sglang:eplb_balancedness summary
sglang:eplb_balancedness_count{forward_mode="decode",model_name="Qwen/Qwen3-235B-A22B"} 4.0
sglang:eplb_balancedness_sum{forward_mode="decode",model_name="Qwen/Qwen3-235B-A22B"} 3.2
"""


def test_vllm_metrics_fill_the_record():
    metrics = parse_metrics(VLLM)
    assert metrics.engine == "vllm" and metrics.error is None
    assert metrics.requests_running == 5 and metrics.requests_waiting == 4  # summed over the engines
    assert metrics.kv_cache_usage == pytest.approx(0.375)  # averaged
    assert metrics.prefix_cache_hit_rate == pytest.approx(0.25)
    assert metrics.spec_accept_rate == pytest.approx(0.6) and metrics.accept_len == pytest.approx(2.8)
    assert metrics.ep_balancedness is None and metrics.server_tokens_per_s is None  # not exported


def test_sglang_metrics_fill_the_record():
    metrics = parse_metrics(SGLANG)
    assert metrics.engine == "sglang"
    assert (metrics.requests_running, metrics.requests_waiting) == (7, 1)
    assert metrics.kv_cache_usage == pytest.approx(0.28) and metrics.prefix_cache_hit_rate == pytest.approx(
        0.0075
    )
    assert metrics.accept_len == pytest.approx(2.6) and metrics.spec_accept_rate is None
    assert metrics.ep_balancedness == pytest.approx(0.8) and metrics.server_tokens_per_s == pytest.approx(
        812.5
    )


def test_what_is_not_exported_is_none_never_zero():
    only_running = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
    metrics = parse_metrics(only_running)
    assert metrics.requests_running == 0  # exported as 0: a real 0
    others = {f.name: getattr(metrics, f.name) for f in fields(RemoteMetrics)} | {"requests_running": None}
    assert set(others.values()) == {None, "vllm"}
    # counters at 0 (no speculation yet): a rate of 0/0 is not known, not 0
    idle = VLLM.replace("} 300.0", "} 0.0").replace("} 100.0", "} 0.0").replace("} 1000.0", "} 0.0")
    assert parse_metrics(idle).spec_accept_rate is None and parse_metrics(idle).accept_len is None
    assert parse_metrics(idle).prefix_cache_hit_rate is None


def test_a_server_without_metrics_or_with_a_broken_text_gives_a_record_of_nones():
    fake = FakeOpenAI(full_reply("x"))
    try:
        metrics = fetch_metrics(RemoteEndpoint("fake", fake.url).metrics_url)
    finally:
        fake.stop()
    assert metrics.error and "no /metrics" in metrics.error and metrics.kv_cache_usage is None
    with pytest.raises(ValueError):
        parse_metrics("<html>not prometheus</html>")


@pytest.mark.parametrize(
    ("url", "base", "metrics"),
    [
        ("gpu-box:8000", "http://gpu-box:8000/v1", "http://gpu-box:8000/metrics"),
        ("https://h.example/v1/", "https://h.example/v1", "https://h.example/metrics"),
        ("http://h:1/api/v1", "http://h:1/api/v1", "http://h:1/api/metrics"),
    ],
)
def test_endpoints_are_normalized(url, base, metrics):
    endpoint = RemoteEndpoint("x", url)
    assert (endpoint.base_url, endpoint.metrics_url) == (base, metrics)


@pytest.mark.parametrize("url", ["ftp://h", "http://", "http://user:pw@h", "http://h?k=1", "http://h:99999"])
def test_bad_addresses_are_refused(url):
    from engine.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError):
        RemoteEndpoint("x", url)
