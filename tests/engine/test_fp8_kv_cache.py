"""An FP8 KV cache (``kv_cache_dtype="fp8"``) on the CPU path: four times float32's blocks in
the same bytes, per-layer scales calibrated at start-up, and the engine's teacher-forced greedy
choice the exact cache's at nearly every position; copy-on-write forks work on FP8 blocks."""

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.engine.conftest import teacher_forced_agreement

KV_BYTES = 32 << 20


@pytest.fixture(scope="module")
def fp8() -> LLM:
    return LLM("smollm2", max_model_len=512, kv_cache_bytes=KV_BYTES, kv_cache_dtype="fp8")


def test_fp8_pool_holds_four_times_the_float32_blocks_in_the_same_bytes(fp8: LLM) -> None:
    exact = LLM("smollm2", max_model_len=512, kv_cache_bytes=KV_BYTES)
    assert fp8.engine.runner.bytes_per_block * 4 == exact.engine.runner.bytes_per_block
    assert fp8.engine.runner.num_blocks == KV_BYTES // fp8.engine.runner.bytes_per_block


def test_fp8_scales_are_calibrated_per_layer(fp8: LLM) -> None:
    scales = fp8.engine.runner.model.kv_scales
    assert len(set(scales)) == len(scales), "every layer gets its own scales"
    assert all(0 < k < 1 and 0 < v < 1 for k, v in scales)


def test_unknown_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_fp8_engine_picks_the_exact_caches_greedy_token_at_nearly_every_position(
        fp8: LLM) -> None:
    agreement = teacher_forced_agreement(fp8)
    assert agreement >= 0.9, agreement


def test_fp8_parallel_samples_fork_blocks_and_free_them_all(fp8: LLM) -> None:
    prompt = fp8.engine.render_chat([{"role": "user", "content": "Name a colour."}])
    free = fp8.engine.kv.pool.num_free
    out = fp8.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20))
    assert len(out[0].outputs) == 3
    assert all(len(c.token_ids) == 20 or c.finish_reason == "stop" for c in out[0].outputs)
    assert fp8.engine.kv.pool.num_free == free
