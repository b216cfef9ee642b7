"""/metrics exposes vLLM-style names (``chatgate:`` prefix) that move with
traffic; /healthz."""

from __future__ import annotations

import random
import threading
import time
import uuid

import httpx
import pytest
from chatgate_testlib import auth
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from chatgate.metrics import ITL_BUCKETS, LABELS, Metrics

NAMES = [
    "chatgate:num_requests_running",
    "chatgate:num_requests_waiting",
    "chatgate:kv_cache_usage_perc",
    "chatgate:prefix_cache_queries_total",
    "chatgate:prefix_cache_hits_total",
    "chatgate:time_to_first_token_seconds_count",
    "chatgate:inter_token_latency_seconds_count",
    "chatgate:e2e_request_latency_seconds_count",
    "chatgate:prompt_tokens_total",
    "chatgate:generation_tokens_total",
    "chatgate:num_pinned_sessions",
    "chatgate:kv_cache_waste_perc",
    "chatgate:engine_steps_total",
    "chatgate:engine_prompt_steps_total",
    "chatgate:engine_step_seconds_total",
]


def test_metrics_names_and_types(server):
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name, kind in [("chatgate:num_requests_running", "gauge"),
                       ("chatgate:kv_cache_usage_perc", "gauge"),
                       ("chatgate:prefix_cache_queries_total", "counter"),
                       ("chatgate:time_to_first_token_seconds", "histogram"),
                       ("chatgate:inter_token_latency_seconds", "histogram"),
                       ("chatgate:e2e_request_latency_seconds", "histogram")]:
        assert f"# TYPE {name} {kind}" in text
    m = server.metrics()
    for name in NAMES:
        assert name in m, name


def test_metrics_move_with_traffic(server):
    before = server.metrics()
    system = f"[{uuid.uuid4().hex}] " + "You answer in exactly one word. " * 8
    body = {"model": "smollm2", "temperature": 0, "max_tokens": 6,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Hi"}]}
    sid = f"metrics-{uuid.uuid4().hex}"
    for extra in ({}, {"session_id": sid}):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, **extra},
                       headers=auth("alice"), timeout=60)
        assert r.status_code == 200
    usage = r.json()["usage"]
    after = server.metrics()
    assert after["chatgate:num_pinned_sessions"] == before["chatgate:num_pinned_sessions"] + 1
    # with the session's blocks pinned and nothing running, the KV gauges are the engine's
    # counters as fractions: blocks used / blocks, 1 - tokens stored / slots of the used blocks
    stats = server.wait_idle()
    gauges = server.metrics()
    assert stats["num_blocks_used"] > 0
    assert gauges["chatgate:kv_cache_usage_perc"] == pytest.approx(
        stats["num_blocks_used"] / stats["num_blocks_total"])
    assert gauges["chatgate:kv_cache_waste_perc"] == pytest.approx(
        1 - stats["num_tokens_stored"] / (stats["num_blocks_used"] * stats["block_size"]))
    httpx.delete(f"{server.url}/v1/sessions/{sid}", headers=auth("alice"))
    assert server.metrics()["chatgate:num_pinned_sessions"] == \
        before["chatgate:num_pinned_sessions"]

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta("chatgate:time_to_first_token_seconds_count") == 2
    assert delta("chatgate:e2e_request_latency_seconds_count") == 2
    assert delta("chatgate:inter_token_latency_seconds_count") >= 2
    assert delta("chatgate:prompt_tokens_total") == 2 * usage["prompt_tokens"]
    assert delta("chatgate:generation_tokens_total") >= 2
    assert delta("chatgate:prefix_cache_queries_total") == 2 * usage["prompt_tokens"]
    assert delta("chatgate:prefix_cache_hits_total") >= usage["prompt_tokens_details"][
        "cached_tokens"] > 0
    # the engine loop's counters (from the idle snapshot): one prompt step per request at least,
    # and a step per generated token at least (the requests ran one after the other)
    assert gauges["chatgate:engine_prompt_steps_total"] - before[
        "chatgate:engine_prompt_steps_total"] >= 2
    assert gauges["chatgate:engine_steps_total"] - before["chatgate:engine_steps_total"] >= \
        delta("chatgate:generation_tokens_total")
    assert gauges["chatgate:engine_step_seconds_total"] > before[
        "chatgate:engine_step_seconds_total"]


def test_running_and_kv_gauges_follow_a_live_request(server):
    seen = {"running": 0.0, "kv": 0.0}
    body = {"model": "smollm2", "max_tokens": 50, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Write a poem."}]}
    first = threading.Event()

    def run():
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          headers=auth("alice"), timeout=120) as r:
            for _ in r.iter_lines():
                first.set()

    t = threading.Thread(target=run)
    base = server.metrics()
    t.start()
    assert first.wait(60)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and seen["running"] == 0:
        m = server.metrics()
        seen["running"] = max(seen["running"], m["chatgate:num_requests_running"])
        seen["kv"] = max(seen["kv"], m["chatgate:kv_cache_usage_perc"])
        time.sleep(0.05)
    t.join(120)
    assert seen["running"] >= 1
    assert seen["kv"] > base["chatgate:kv_cache_usage_perc"]
    server.wait_idle()
    assert server.metrics()["chatgate:num_requests_running"] == 0


def test_healthz(server):
    h = server.health()
    assert h["status"] == "ok"
    assert h["model"] == "smollm2"
    assert h["session_store"] == "RedisSessionStore" and h["session_store_ok"] is True
    for key in ("num_requests_running", "num_blocks_total", "num_blocks_used",
                "num_pinned_sessions", "kv_cache_usage"):
        assert key in h["engine"]


def test_a_merged_delta_counts_in_the_itl_histogram_as_its_tokens_one_by_one():
    """``observe_tokens(n, gap)`` exposes what n observations of ``gap / n`` in
    prometheus_client's own Histogram expose: every bucket and the count equal, the sum up to
    rounding."""
    reference = CollectorRegistry()
    histogram = Histogram("chatgate:inter_token_latency_seconds", "Time between output tokens.",
                          LABELS, buckets=ITL_BUCKETS, registry=reference).labels("m", "r")
    metrics = Metrics("m", "r")
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 9)
        gap = n * rng.choice([*ITL_BUCKETS, 0.0, 1e3, rng.uniform(0, 0.5)])  # edges included
        metrics.observe_tokens(n, gap)
        for _ in range(n):
            histogram.observe(gap / n)

    def samples(registry: CollectorRegistry) -> dict:
        text = generate_latest(registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text)
                if family.name == "chatgate:inter_token_latency_seconds"
                for s in family.samples}

    ours, theirs = samples(metrics.registry), samples(reference)
    assert ours.keys() == theirs.keys() and len(ours) == len(ITL_BUCKETS) + 3  # +Inf, count, sum
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-12), key
