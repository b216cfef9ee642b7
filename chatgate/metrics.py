"""Prometheus metrics with vLLM's names under the ``chatgate:`` prefix.

Engine gauges (running/waiting requests, KV usage, pinned sessions, KV waste) are read from
``engine.stats()`` at scrape time; latencies and token counters are observed by the gateway as
requests stream (summed over the front-end processes when there are several)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from engine.client import EngineStats

PREFIX = "chatgate:"
LABELS = ["model_name", "replica"]  # every series names the model and the gateway replica

disable_created_metrics()  # no *_created series (as vLLM)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineCollector(Collector):
    def __init__(self, get_stats: Callable[[], EngineStats], labels: list[str]) -> None:
        self._get_stats = get_stats
        self._labels = labels

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
        g.add_metric(self._labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
        c.add_metric(self._labels, value)
        return c

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        s = self._get_stats()
        yield self._gauge("num_requests_running", "Requests in the running batch.",
                          s.num_requests_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                          s.num_requests_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                          s.kv_cache_usage)
        yield self._gauge("num_pinned_sessions", "Sessions whose KV blocks are pinned.",
                          s.num_pinned_sessions)
        yield self._gauge("num_pinned_blocks", "KV blocks held by pinned sessions.",
                          s.num_pinned_blocks)
        yield self._gauge("kv_cache_waste_perc",
                          "Measured fraction of allocated KV slots holding no token (0-1).",
                          s.kv_waste)
        yield self._gauge("num_free_blocks", "Free KV blocks.", s.num_blocks_free)
        yield self._counter("num_preemptions",
                            "Requests preempted (recomputed) for lack of KV blocks.",
                            s.num_preemptions)
        yield from self._engine_loop(s)
        yield from self._host_tier(s)
        yield from self._spec_decode(s)

    def _engine_loop(self, s: EngineStats) -> Iterable[CounterMetricFamily]:
        """The engine process's steps: their rate, their share with a prompt, and how busy
        the loop is (seconds in steps per second)."""
        yield self._counter("engine_steps", "Engine steps (one forward pass each).",
                            s.engine_steps)
        yield self._counter("engine_prompt_steps", "Engine steps that computed prompt tokens.",
                            s.engine_prompt_steps)
        yield self._counter("engine_step_seconds", "Seconds the engine process spent in steps.",
                            s.engine_step_seconds)

    def _spec_decode(self, s: EngineStats) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        """Speculative decoding (--speculative-config; zeros when off), vLLM's names."""
        yield self._counter("spec_decode_num_drafts", "Speculative verify passes (one per "
                            "sequence and step with drafts).", s.spec_decode_num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens verified.",
                            s.spec_decode_num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            s.spec_decode_num_accepted_tokens)
        drafted = s.spec_decode_num_draft_tokens
        yield self._gauge("spec_decode_draft_acceptance_rate", "Accepted / verified draft "
                          "tokens since start (0 when none).",
                          s.spec_decode_num_accepted_tokens / drafted if drafted else 0.0)

    def _host_tier(self, s: EngineStats) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        """The host KV tier (--kv-offloading-size); zeros when it is off."""
        total = s.host_kv_blocks_total
        yield self._gauge("host_kv_cache_usage_perc",
                          "Fraction of host-tier KV blocks stored or being stored (0-1).",
                          s.host_kv_blocks_used / total if total else 0.0)
        yield self._counter("host_cache_hits",
                            "Prompt tokens served from the host KV tier (part of the prefix "
                            "cache hits).", s.host_cache_hits)
        yield self._counter("kv_offload_blocks", "KV blocks copied from the device to the "
                            "host tier.", s.num_blocks_offloaded)
        yield self._counter("kv_reload_blocks", "KV blocks copied back from the host tier to "
                            "the device.", s.num_blocks_reloaded)
        yield self._counter("kv_offload_bytes", "Bytes copied from the device to the host "
                            "tier.", s.kv_offload_bytes)
        yield self._counter("kv_reload_bytes", "Bytes copied from the host tier to the device.",
                            s.kv_reload_bytes)
        yield self._counter("kv_reload_seconds", "Device time of the copies from the host tier "
                            "back to the device.", s.kv_reload_seconds)


class _RepeatedHistogram(Histogram):
    """prometheus_client's Histogram that also takes ``count`` equal observations in one call
    (the tokens of a merged delta), where ``observe`` takes them one at a time at 1.75 us each
    (a lock, a scan of the bounds, two locked increments). It adds to the parent's own value
    slots (``_sum``, ``_buckets``, ``_upper_bounds``: private to prometheus_client, so
    tests/chatgate/test_metrics.py checks the exposition against the parent's), so the
    exposition, and the files of multiprocess mode, are the parent's."""

    def observe_repeated(self, value: float, count: int) -> None:
        self._sum.inc(value * count)
        self._buckets[bisect.bisect_left(self._upper_bounds, value)].inc(count)


class Metrics:
    """One registry per app (so tests can build several apps in one process).

    With ``multiprocess_dir`` (one of several front-end processes, ``--api-server-count``) the
    gateway's own series are kept in prometheus_client's multiprocess files in that folder, and
    a scrape of any front-end reads them all: counters and histograms summed over the
    front-ends, the stream gauge summed over the live ones. The process must have had
    ``PROMETHEUS_MULTIPROC_DIR`` set to that folder before it imported prometheus_client,
    which picks its value store at import."""

    def __init__(self, model_name: str, replica_id: str,
                 multiprocess_dir: str | None = None) -> None:
        self.model_name = model_name
        self.replica_id = replica_id
        self.registry = CollectorRegistry()
        r: CollectorRegistry | None = self.registry
        if multiprocess_dir is not None:
            if values.ValueClass is values.MutexValue:
                raise RuntimeError("PROMETHEUS_MULTIPROC_DIR was not set when prometheus_client "
                                   "was imported")
            MultiProcessCollector(self.registry, path=multiprocess_dir)
            r = None  # the series are read from the files, not from this process's objects
        lbl = LABELS
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            lbl, registry=r)
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens served from cached KV blocks.",
            lbl, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.",
                                     lbl, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Generation tokens processed.", lbl, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests.",
                                       lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time to first token.", lbl, buckets=TTFT_BUCKETS, registry=r)
        self.itl = _RepeatedHistogram(PREFIX + "inter_token_latency_seconds",
                                      "Time between output tokens.", lbl, buckets=ITL_BUCKETS,
                                      registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "End-to-end request latency.", lbl, buckets=E2E_BUCKETS, registry=r)
        self.active_streams = Gauge(PREFIX + "num_active_streams",
                                    "Open gateway streams by transport.", lbl + ["transport"],
                                    registry=r, multiprocess_mode="livesum")
        self.rate_limited = Counter(PREFIX + "rate_limited_requests",
                                    "Requests refused by a tenant limit.", lbl, registry=r)

        # The labelled children, made up front: every series exists from the first scrape,
        # and the per-token path skips the label lookup.
        m = (model_name, replica_id)
        self._prefix_cache_queries = self.prefix_cache_queries.labels(*m)
        self._prefix_cache_hits = self.prefix_cache_hits.labels(*m)
        self._prompt_tokens = self.prompt_tokens.labels(*m)
        self._rate_limited = self.rate_limited.labels(*m)
        self._generation_tokens = self.generation_tokens.labels(*m)
        self._ttft = self.ttft.labels(*m)
        self._e2e = self.e2e.labels(*m)
        self._itl = self.itl.labels(*m)
        self._finished = {reason: self.request_success.labels(*m, reason)
                          for reason in ("stop", "length", "abort")}
        self._streams = {transport: self.active_streams.labels(*m, transport)
                         for transport in ("http", "ws")}

    def attach_engine(self, get_stats: Callable[[], EngineStats]) -> None:
        self.registry.register(_EngineCollector(get_stats, [self.model_name, self.replica_id]))

    def stream_started(self, transport: str) -> None:
        self._streams[transport].inc()

    def stream_ended(self, transport: str) -> None:
        self._streams[transport].dec()

    def observe_rate_limited(self) -> None:
        self._rate_limited.inc()

    def observe_prompt(self, prompt_tokens: int, cached_tokens: int) -> None:
        self._prefix_cache_queries.inc(prompt_tokens)
        self._prefix_cache_hits.inc(cached_tokens)
        self._prompt_tokens.inc(prompt_tokens)

    def observe_first_tokens(self, num_tokens: int, ttft_s: float) -> None:
        self._generation_tokens.inc(num_tokens)
        self._ttft.observe(ttft_s)

    def observe_tokens(self, num_tokens: int, gap_s: float) -> None:
        """``num_tokens`` arrived together ``gap_s`` after the previous ones: each counts as
        ``gap_s / num_tokens`` apart."""
        self._generation_tokens.inc(num_tokens)
        self._itl.observe_repeated(gap_s / num_tokens, num_tokens)

    def observe_finish(self, reasons: set[str], e2e_s: float | None) -> None:
        """A request ended with these finish reasons (one per sample kind); ``e2e_s`` when it
        finished rather than being aborted."""
        for reason in reasons:
            child = self._finished.get(reason) or self.request_success.labels(
                self.model_name, self.replica_id, reason)
            child.inc()
        if e2e_s is not None:
            self._e2e.observe(e2e_s)
