"""The offline-throughput runner and the decode-step module of gpu_e2e.py: the steady decode
steps they pick from step timings, and a real run on the CPU read through the engine's step
timing only (every token the requests needed is accounted for, no CUDA graph on the CPU, the
timing turned off again afterwards)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import decode_step, offline_throughput  # noqa: E402
from engine import LLM  # noqa: E402
from engine.step_timing import StepTiming  # noqa: E402


def _timing(rows: int, graph: int | None, host_s: float = 1.0, ctx: int = 0) -> StepTiming:
    return StepTiming(host_s, {}, rows=rows, context_tokens=ctx, tokens_computed=rows,
                      graph_size=graph)


def test_steady_decode_steps_are_graph_steps_after_a_graph_step_with_15_16_of_the_rows():
    timings = [_timing(16, 16), _timing(16, 16), _timing(16, None), _timing(16, 16),
               _timing(15, 16), _timing(14, 16), _timing(16, 16)]
    assert offline_throughput.steady_decode_steps(timings, 16) == [1, 4, 6]


def test_step_summary_splits_graph_and_eager_time_and_takes_medians_of_steady_steps():
    timings = [_timing(4, None, 3.0, 400), _timing(0, None, 0.5), _timing(4, 4, 1.0, 404),
               _timing(4, 4, 2.0, 408), _timing(4, 4, 4.0, 412)]
    s = offline_throughput.summarise_steps(timings, 4)
    assert (s["steps"], s["graph_steps"], s["eager_steps"]) == (5, 3, 1)
    assert s["graph_steps_seconds"] == 7.0 and s["eager_steps_seconds"] == 3.5
    assert s["full_decode_steps"] == 2 and s["full_decode_step_median_s"] == 3.0
    assert s["full_decode_graph_median_s"] is None  # no CUDA events on these timings
    assert (s["full_decode_step_median_rows"], s["full_decode_step_median_ctx"]) == (4, 102)
    assert s["step_work"][0] == (4, 400) and s["step_rows"] == [4, 0, 4, 4, 4]


def test_engine_throughput_on_cpu_accounts_for_every_token_through_the_step_timing(tiny_model):
    llm = LLM(tiny_model, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=256,
              num_kv_blocks=64, enable_prefix_caching=False)
    requests = offline_throughput.make_requests(6, 1000, 0, (8, 32), (4, 12))
    et = offline_throughput.engine_throughput(llm, requests, torch.device("cpu"))
    assert llm.engine.step_timings is None  # on only while it measured
    assert et["output_tokens"] == sum(out for _, out in requests)
    assert et["prompt_tokens"] == sum(len(prompt) for prompt, _ in requests)
    # every prompt token, then every output token but the last (sampled, never fed back)
    computed = sum(tokens for tokens, _ in et["step_work"])
    assert computed == et["prompt_tokens"] + et["output_tokens"] - len(requests)
    assert len(et["step_work"]) == len(et["step_rows"]) == et["steps"]
    assert max(et["step_rows"]) <= 4
    assert all(ctx >= tokens for tokens, ctx in et["step_work"])
    assert et["graph_steps"] == et["full_decode_steps"] == 0
    assert et["eager_steps"] == et["steps"] and et["graph_steps_seconds"] == 0
    assert et["full_decode_step_median_s"] is None


def test_decode_step_measurements_are_skipped_without_cuda_graphs(tiny_model):
    llm = LLM(tiny_model, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=256,
              num_kv_blocks=64)
    cpu = torch.device("cpu")
    r = decode_step.decode_step_roofline(llm, 4, 32, 1e9, cpu)
    assert r == {"skipped": "no CUDA graph of that batch size (eager run or CPU)"}
    assert decode_step.decode_step_roofline(llm, 4, 1024, 1e9, cpu)["skipped"].startswith(
        "needs 257 blocks")
    et = {"full_decode_step_median_ctx": None}
    assert decode_step.measure_decode_steps(llm, et, 4, [32], 64, 1e9, cpu) == {
        "decode_step": []}


@pytest.mark.parametrize("model,vocab", [("dummy:smollm2-135m", 49152), ("smollm2", 1000)])
def test_random_prompts_draw_from_the_dummy_vocabulary_or_the_first_thousand_ids(model, vocab):
    assert offline_throughput.prompt_vocab(model) == vocab
