"""A snapshot of the engine's counters and gauges (what ``stats()`` and /metrics report)."""

import msgspec


class EngineStats(msgspec.Struct, frozen=True):
    num_requests_running: int
    num_requests_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_pinned_sessions: int
    num_pinned_blocks: int
    num_preemptions: int
    num_prefill_tokens_computed: int
    num_decode_tokens_computed: int
    num_tokens_stored: int
    # the host KV tier (--kv-offloading-size; all 0 when off)
    host_kv_blocks_total: int = 0
    host_kv_blocks_used: int = 0  # stored or being stored
    host_cache_hits: int = 0  # prompt tokens served from the host tier (within prefix hits)
    num_blocks_offloaded: int = 0  # device → host block copies issued
    num_blocks_reloaded: int = 0  # host → device block copies issued
    kv_offload_bytes: int = 0
    kv_reload_bytes: int = 0
    kv_reload_seconds: float = 0.0  # device time of the completed host → device copies

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks in use (held by a request or a pinned session)."""
        return self.num_blocks_used / self.num_blocks_total

    @property
    def kv_waste(self) -> float:
        """1 − tokens stored / token slots in the blocks in use (0 when nothing is in use)."""
        slots = self.num_blocks_used * self.block_size
        return 1.0 - self.num_tokens_stored / slots if slots else 0.0

    @property
    def num_tokens_computed(self) -> int:
        return self.num_prefill_tokens_computed + self.num_decode_tokens_computed
