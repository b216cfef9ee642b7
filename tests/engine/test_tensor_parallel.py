"""Tensor parallelism on the CPU (Gloo): the same greedy tokens as one process, clear errors
for sizes that do not split and for a worker that dies."""

import json
import os
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import load_model
from engine.tensor_parallel import Shard, WorkerDied
from tests.engine.conftest import conversations

GREEDY = SamplingParams(temperature=0, max_tokens=16)

# a small Llama with q/k/v biases (the Qwen2 layout) whose sizes split in two
TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


@pytest.fixture
def tiny_model(tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return f"dummy:{path}"


def test_the_shards_put_back_together_are_the_full_weights(tiny_model) -> None:
    """Column-split matrices (q/k/v, gate/up, vocabulary rows) stack back by rows, row-split
    ones (o, down) by columns, and norms are every rank's own copy; a dummy model generated
    shard by shard holds exactly those shards."""
    cpu = torch.device("cpu")
    whole = load_model(tiny_model, cpu, torch.float32)
    full = whole.state_dict
    shards = [Shard(r, 2).weights(full, whole.config) for r in range(2)]
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        if "o_proj" in name or "down_proj" in name:
            assert torch.equal(torch.cat(parts, dim=1), tensor), name
        elif "norm" in name:
            assert all(p is tensor for p in parts), name
        else:
            assert torch.equal(torch.cat(parts, dim=0), tensor), name
            assert parts[0].shape[0] == tensor.shape[0] // 2, name
    generated = load_model(tiny_model, cpu, torch.float32, shard=Shard(1, 2))
    assert generated.state_dict.keys() == shards[1].keys()
    for name, tensor in shards[1].items():
        assert torch.equal(generated.state_dict[name], tensor), name


def test_smollm2_split_three_ways_gives_the_single_process_greedy_tokens() -> None:
    """SmolLM2's 9 heads and 3 KV heads split over 3 ranks: float32 greedy tokens equal the
    single-process engine's, token for token."""
    convs = conversations()[:4]
    single = [o.outputs[0].token_ids for o in LLM("smollm2").chat(convs, GREEDY)]
    llm = LLM("smollm2", tensor_parallel_size=3)
    try:
        split = [o.outputs[0].token_ids for o in llm.chat(convs, GREEDY)]
    finally:
        llm.engine.shutdown()
    assert split == single
    assert all(len(t) > 0 for t in split)


def test_a_dummy_model_split_two_ways_gives_the_single_process_greedy_tokens(tiny_model) -> None:
    prompts = [[7, 8, 9, 10], list(range(20, 60)), [3] * 17]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    single = [o.outputs[0].token_ids for o in LLM(tiny_model).generate(prompts, params)]
    llm = LLM(tiny_model, tensor_parallel_size=2)
    try:
        split = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.runner.model.num_kv_heads == 1  # each rank holds half the KV heads
    finally:
        llm.engine.shutdown()
    assert split == single


def test_sizes_the_ranks_cannot_split_are_refused_before_any_worker_starts() -> None:
    with pytest.raises(ValueError, match="num_attention_heads=9.*num_key_value_heads=3"):
        LLM("smollm2", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM("smollm2", tensor_parallel_size=3, kv_offloading_size=1.0)


@pytest.mark.timeout(120)
def test_a_killed_worker_makes_the_next_step_fail_with_a_clear_error(tiny_model) -> None:
    llm = LLM(tiny_model, tensor_parallel_size=2)
    try:
        assert llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids
        worker = llm.engine.runner.tp.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        start = time.monotonic()
        with pytest.raises(WorkerDied, match="rank 1 exited"):
            llm.generate([[4, 5, 6]], GREEDY)
        assert time.monotonic() - start < 10
    finally:
        llm.engine.shutdown()


def test_sessions_and_shared_prefixes_across_ranks_match_one_process(tiny_model) -> None:
    """A second turn continues its pinned session (only new tokens computed) and a shared
    prefix is reused, on every rank's pool alike: the tokens equal one process's."""
    prefix = list(range(100, 140))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(llm: LLM) -> tuple[list[list[int]], int]:
        eng = llm.engine
        outputs = []
        history = prefix + [5, 6, 7]
        for turn in range(2):
            eng.add_request(f"turn{turn}", history, params, session_id="s")
            eng.add_request(f"other{turn}", prefix + [9, turn], params)
            done: dict[str, list[int]] = {}
            while eng.has_unfinished():
                for o in eng.step():
                    done.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            outputs += [done[f"turn{turn}"], done[f"other{turn}"]]
            history = history + done[f"turn{turn}"] + [11, 12]
        return outputs, eng.stats().prefix_cache_hits

    single = run(LLM(tiny_model, num_kv_blocks=64))
    llm = LLM(tiny_model, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        split = run(llm)
    finally:
        llm.engine.shutdown()
    assert split == single
    assert split[1] > len(prefix)  # the shared prefix and the session were reused
