"""/metrics' host KV tier series (``--kv-offloading-size``) report the engine's counters."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from chatgate.metrics import Metrics
from engine import LLM, SamplingParams


def _samples(metrics: Metrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_host_tier_series_follow_offloads_and_reloads(tiny_model) -> None:
    llm = LLM(tiny_model, num_kv_blocks=16, kv_offloading_size=0.01)
    metrics = Metrics("tiny", "r0")
    metrics.attach_engine(llm.stats)
    assert _samples(metrics)["chatgate:kv_reload_blocks_total"] == 0
    params = SamplingParams(max_tokens=1)
    prompt = list(range(100, 180))  # five full blocks
    llm.generate(prompt, params)
    for start in (1000, 2000):  # cycle the device pool: the prompt's blocks leave it
        llm.generate(list(range(start, start + 120)), params)
    again = llm.generate(prompt, params)[0]
    stats = llm.stats()
    got = _samples(metrics)
    assert again.num_cached_tokens == 64 and stats.host_cache_hits == 64
    assert got["chatgate:host_cache_hits_total"] == 64
    assert got["chatgate:kv_reload_blocks_total"] == stats.num_blocks_reloaded == 4
    assert got["chatgate:kv_reload_bytes_total"] == 4 * llm.engine.runner.bytes_per_block
    assert got["chatgate:kv_offload_blocks_total"] == stats.num_blocks_offloaded > 0
    assert got["chatgate:kv_offload_bytes_total"] == stats.kv_offload_bytes
    assert got["chatgate:kv_reload_seconds_total"] == stats.kv_reload_seconds > 0
    assert got["chatgate:host_kv_cache_usage_perc"] == (
        stats.host_kv_blocks_used / stats.host_kv_blocks_total)
