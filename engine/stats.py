"""A snapshot of the engine's counters and gauges (what ``stats()`` and /metrics report)."""

from dataclasses import asdict
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # the client face imports this module: no engine internals at run time
    from engine.llm_engine import LLMEngine


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
    # speculative decoding (vLLM's names; all 0 when off): verifies, drafted tokens, accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # the engine process's loop while serving (0 in an offline ``LLM``, whose caller steps it):
    # the steps it took, those that computed prompt tokens, and the seconds spent in them
    engine_steps: int = 0
    engine_prompt_steps: int = 0
    engine_step_seconds: float = 0.0

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


def snapshot(engine: "LLMEngine") -> EngineStats:
    """``engine``'s counters and gauges now."""
    kv, scheduler = engine.kv, engine.scheduler
    pool = kv.pool
    extra: dict = {}
    host, moved = kv.host, engine.kv_transfer
    if host is not None and moved is not None:
        extra = {"host_kv_blocks_total": host.num_slots, "host_cache_hits": kv.host_hits,
                 "host_kv_blocks_used": host.num_slots - len(host.free), **moved.counters()}
    if engine.speculator is not None:
        extra.update({f"spec_decode_{name}": value
                      for name, value in asdict(engine.speculator.counters).items()})
    return EngineStats(
        num_requests_running=len({s.request_id for s in scheduler.running}),
        num_requests_waiting=len({s.request_id for s in scheduler.waiting}),
        num_blocks_total=pool.num_blocks,
        num_blocks_used=pool.num_used,
        num_blocks_free=pool.num_free,
        block_size=engine.config.block_size,
        prefix_cache_queries=kv.prefix_queries,
        prefix_cache_hits=kv.prefix_hits,
        num_pinned_sessions=len(kv.pinned_sessions()),
        num_pinned_blocks=kv.num_pinned_blocks,
        num_preemptions=scheduler.num_preemptions,
        num_prefill_tokens_computed=engine.num_prefill_tokens,
        num_decode_tokens_computed=engine.num_decode_tokens,
        num_tokens_stored=kv.stored_tokens(scheduler.running),
        **extra,
    )
