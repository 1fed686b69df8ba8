"""Metrics under vLLM's names (issue 45, item 4): every series vLLM's example Grafana dashboard
queries is on /metrics with the labels its queries use; vLLM's V1 families are there; each
`vllm:` family agrees with its `pypto_` twin; the per-request and per-step histograms count
what was served.
"""

from __future__ import annotations

import httpx
import pytest
from live_server import serving, tiny_llm
from prometheus_client.parser import text_string_to_metric_families

MODEL = "llama-gqa4-tied"

DASHBOARD_SERIES = {
    # every series the dashboard's queries read (examples/online_serving/prometheus_grafana/
    # grafana.json in vLLM's repository), each selected by {model_name="$model_name"}
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
}
V1_FAMILIES = {
    # vLLM V1's other families (its docs' metrics list) this server has a meaning for
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:inter_token_latency_seconds_count",
    "vllm:iteration_tokens_total_count",
    "vllm:request_inference_time_seconds_count",
    "vllm:request_time_per_output_token_seconds_count",
    "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_count",
    "vllm:cache_config_info",
}
TWINS = {  # vLLM's sample -> ours
    "vllm:num_requests_running": "pypto_num_requests_running",
    "vllm:num_requests_waiting": "pypto_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "pypto_kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "pypto_kv_cache_usage_perc",
    "vllm:prompt_tokens_total": "pypto_prompt_tokens_total",
    "vllm:generation_tokens_total": "pypto_generation_tokens_total",
    "vllm:prefix_cache_queries_total": "pypto_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "pypto_prefix_cache_hits_total",
    "vllm:num_preemptions_total": "pypto_num_preemptions_total",
    "vllm:time_to_first_token_seconds_sum": "pypto_time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count": "pypto_time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_sum": "pypto_inter_token_latency_seconds_sum",
    "vllm:time_per_output_token_seconds_count": "pypto_inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "pypto_e2e_request_latency_seconds_sum",
    "vllm:request_queue_time_seconds_count": "pypto_request_queue_time_seconds_count",
    "vllm:request_prompt_tokens_sum": "pypto_request_prompt_tokens_sum",
    "vllm:iteration_tokens_total_sum": "pypto_iteration_tokens_total_sum",
}


def samples(url: str) -> dict[tuple[str, str], float]:
    """/metrics' samples: (name, finished_reason or "") -> value, every one of them checked
    to carry model_name "tiny" (and vLLM's engine label on vllm: series)."""
    out: dict[tuple[str, str], float] = {}
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:") and s.name != "vllm:cache_config_info":
                assert s.labels.get("model_name") == "tiny" and s.labels.get("engine") == "0", s
            if s.name.endswith("_created"):
                continue
            out[(s.name, s.labels.get("finished_reason", "") + s.labels.get("le", ""))] = s.value
    return out


@pytest.fixture(scope="module")
def served(tiny_model):
    """A fresh server, and what it was sent: completions of known prompt and output sizes."""
    with serving(tiny_llm(tiny_model(MODEL))) as live:
        sent = []
        for prompt, n, max_tokens in (([5, 6, 7], 1, 4), ([8, 9, 10, 11, 12], 2, 3)):
            body = {"prompt": prompt, "n": n, "max_tokens": max_tokens, "ignore_eos": True}
            r = httpx.post(live.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            sent.append((len(prompt), n, max_tokens))
        yield live, sent


def test_every_dashboard_series_and_v1_family_is_there(served):
    live, _ = served
    names = {name for name, _ in samples(live.url)}
    assert DASHBOARD_SERIES - names == set()
    assert V1_FAMILIES - names == set()
    for finish in ("length",):
        assert ("vllm:request_success_total", finish) in samples(live.url)


def test_vllm_names_and_ours_agree(served):
    live, _ = served
    now = samples(live.url)
    for theirs, ours in TWINS.items():
        assert now[(theirs, "")] == now[(ours, "")], theirs
    assert (
        now[("vllm:request_success_total", "length")]
        == now[("pypto_request_success_total", "length")]
    )


def test_the_per_request_and_per_step_histograms_count_what_was_served(served):
    live, sent = served
    now = samples(live.url)
    assert now[("vllm:request_prompt_tokens_sum", "")] == sum(p for p, _, _ in sent)
    assert now[("vllm:request_generation_tokens_sum", "")] == sum(n * m for _, n, m in sent)
    assert now[("vllm:request_max_num_generation_tokens_sum", "")] == sum(m for _, _, m in sent)
    assert now[("vllm:request_params_n_sum", "")] == sum(n for _, n, _ in sent)
    assert now[("vllm:request_params_max_tokens_sum", "")] == sum(m for _, _, m in sent)
    assert now[("vllm:request_prefill_time_seconds_count", "")] == len(sent)
    # every step's tokens: together, every token computed
    computed = now[("vllm:prompt_tokens_total", "")] + now[("vllm:generation_tokens_total", "")]
    assert now[("vllm:iteration_tokens_total_sum", "")] == computed
    # a request's phases add up: prefill + decode = inference
    phases = (
        now[("vllm:request_prefill_time_seconds_sum", "")]
        + now[("vllm:request_decode_time_seconds_sum", "")]
    )
    assert phases == pytest.approx(now[("vllm:request_inference_time_seconds_sum", "")])


def test_stats_leave_vllms_duplicates_out(served):
    live, _ = served
    stats = httpx.get(live.url + "/stats").json()["metrics"]
    assert "num_requests_running" in stats and not any(k.startswith("vllm:") for k in stats)
