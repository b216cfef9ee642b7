"""CPU-runnable checks of the model runner's CUDA-graph helpers, host-side metadata and host
threads."""

import numpy as np
import pytest
import torch

from engine.cuda_graphs import (
    StepGraphs,
    graph_batch_sizes,
    mixed_shapes,
    pack_step,
    padded_batch_size,
)
from engine.model_runner import ModelRunner, one_host_thread
from engine.scheduler import ScheduledBatch


def test_graph_batch_sizes_pad_to_multiples_of_8_capped():
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1000)[-1] == 256


@pytest.mark.parametrize("n,expected", [(1, 1), (3, 4), (8, 8), (9, 16), (250, 256), (257, None)])
def test_padded_batch_size(n, expected):
    assert padded_batch_size(n, graph_batch_sizes(256)) == expected


class _Seq:
    def __init__(self, tokens, computed, table, drafts=()):
        self.token_ids, self.num_computed_tokens, self.block_table = tokens, computed, table
        self.draft_token_ids = list(drafts)


def test_host_metadata_mixed_batch_matches_definition():
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size = 4
    seqs = [_Seq(list(range(100, 110)), 9, [7, 3, 5]),      # decode: position 9
            _Seq(list(range(200, 206)), 0, [2, 8]),         # prefill of 6
            _Seq(list(range(300, 313)), 5, [1, 4, 6, 9])]   # extend 5..11 (chunk of 7)
    batch = ScheduledBatch(seqs=seqs, num_new_tokens=[1, 6, 7])
    host = runner.host_metadata(batch)
    positions = [9] + list(range(6)) + list(range(5, 12))
    assert host["positions"].tolist() == positions
    assert host["input_ids"].tolist() == [109] + list(range(200, 206)) + list(range(305, 312))
    rows = [0] + [1] * 6 + [2] * 7
    slots = [seqs[r].block_table[p // 4] * 4 + p % 4 for r, p in zip(rows, positions, strict=True)]
    assert host["slot_mapping"].tolist() == slots
    assert host["seq_lens"].tolist() == [10, 6, 12]
    assert host["query_start_loc"].tolist() == [0, 1, 7, 14]
    assert host["block_tables"].tolist() == [[7, 3, 5, 0], [2, 8, 0, 0], [1, 4, 6, 9]]
    assert host["max_query_len"] == 7 and host["max_seq_len"] == 12
    assert host["block_tables"].dtype == np.int32


def test_host_metadata_pure_decode():
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size = 16
    seqs = [_Seq(list(range(40)), 39, [4, 9, 11]), _Seq([5, 6], 1, [2])]
    host = runner.host_metadata(ScheduledBatch(seqs=seqs, num_new_tokens=[1, 1]))
    assert host["input_ids"].tolist() == [39, 6]
    assert host["positions"].tolist() == [39, 1]
    assert host["slot_mapping"].tolist() == [11 * 16 + 7, 2 * 16 + 1]
    assert host["max_query_len"] == 1
    assert "num_drafts" not in host


def _verify_step() -> dict[str, np.ndarray]:
    """A verify step's host metadata: a last token with 2 drafts, and a plain decode row."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size = 4
    seqs = [_Seq([10, 11, 12, 13, 14], 4, [3, 6], drafts=[15, 16]),
            _Seq([20, 21, 22], 2, [5])]
    return runner.host_metadata(ScheduledBatch(seqs=seqs, num_new_tokens=[3, 1]))


def test_host_metadata_speculative_rows_feed_the_drafts_after_the_last_token():
    host = _verify_step()
    assert host["input_ids"].tolist() == [14, 15, 16, 22]
    assert host["positions"].tolist() == [4, 5, 6, 2]
    assert host["slot_mapping"].tolist() == [6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2, 5 * 4 + 2]
    assert host["seq_lens"].tolist() == [7, 3]
    assert host["num_drafts"].tolist() == [2, 0]


def test_a_packed_verify_step_puts_its_tokens_first_and_pads_rows_with_no_tokens():
    host = _verify_step()
    packed = np.full((6, 4 * 3 + 1), 99, dtype=np.int64)  # padded to 4 rows of 3 tokens
    pack_step(packed, host, shape=(4, 12), feed=np.array([-1, 5]))
    ids, positions, slots, feed, seq_lens, starts = packed
    assert ids[:12].tolist() == [14, 15, 16, 22] + [0] * 8
    assert positions[:12].tolist() == [4, 5, 6, 2] + [0] * 8
    assert slots[:12].tolist() == [24, 25, 26, 22] + [-1] * 8  # padding writes no KV
    assert feed[:12].tolist() == [-1, -1, -1, 5] + [-1] * 8  # row 1's first token is fed
    assert seq_lens[:4].tolist() == [7, 3, 0, 0]
    assert starts[:5].tolist() == [0, 3, 4, 4, 4]  # padding rows: no query tokens


def _graphs(max_query_len: int, shapes: list[tuple[int, int]]) -> StepGraphs:
    graphs = StepGraphs.__new__(StepGraphs)  # the selection only: nothing captured
    graphs.max_query_len, graphs.shapes = max_query_len, shapes
    return graphs


def _step(num_new: list[int], table_width: int = 2, drafts: bool = False
          ) -> dict[str, np.ndarray]:
    host = {"seq_lens": np.full(len(num_new), 9), "max_query_len": max(num_new),
            "query_start_loc": np.cumsum([0] + num_new),
            "block_tables": np.zeros((len(num_new), table_width), dtype=np.int32)}
    if drafts:
        host["num_drafts"] = np.asarray(num_new) - 1
    return host


def test_steps_replay_the_smallest_graph_that_holds_them_else_run_eagerly():
    runner = ModelRunner.__new__(ModelRunner)
    runner.max_blocks_per_seq = 8
    runner.decode_graphs = decode = _graphs(1, [(1, 1), (2, 2), (4, 4), (8, 8)])
    runner.verify_graphs = verify = _graphs(5, [(1, 5), (2, 10), (4, 20)])
    runner.mixed_graphs = mixed = _graphs(512, [(8, 256), (8, 512)])
    assert runner._step_graphs(_step([1] * 3)) == (decode, (4, 4))
    assert runner._step_graphs(_step([1] * 9)) is None  # more rows than any graph
    assert runner._step_graphs(_step([5, 1, 3], drafts=True)) == (verify, (4, 20))
    assert runner._step_graphs(_step([2] * 5, drafts=True)) is None  # drafts need every row
    assert runner._step_graphs(_step([2] * 5)) == (mixed, (8, 256))
    assert runner._step_graphs(_step([6])) == (mixed, (8, 256))  # a prompt chunk
    assert runner._step_graphs(_step([300, 1])) == (mixed, (8, 512))
    assert runner._step_graphs(_step([600])) is None  # more tokens than any graph
    assert runner._step_graphs(_step([1], table_width=9)) is None  # wider than captured
    runner.verify_graphs = runner.mixed_graphs = None
    assert runner._step_graphs(_step([3])) is None


def test_mixed_graphs_pad_tokens_to_multiples_of_256_up_to_the_step_budget():
    assert mixed_shapes(256, 2048) == [(256, t) for t in range(256, 2049, 256)]
    assert mixed_shapes(256, 32768)[-1] == (256, 8192)  # larger steps run eagerly
    assert mixed_shapes(1024, 600) == [(256, 256), (256, 512), (256, 768)]
    assert mixed_shapes(4, 256) == [(4, 256)]


def test_fused_forward_matches_unfused_and_shares_weights():
    import torch

    from engine.loader import load_model
    from engine.model import AttentionMetadata, LlamaModel

    loaded = load_model("dummy:qwen2.5-0.5b", torch.device("cpu"), torch.float32, seed=3,
                        use_cache=False)
    plain = LlamaModel(loaded.config, dict(loaded.state_dict), 64, fuse=False)
    weights = dict(loaded.state_dict)
    fused = LlamaModel(loaded.config, weights, 64, fuse=True)
    assert fused.layers[0].q.data_ptr() == fused.layers[0].qkv.data_ptr()
    assert weights["model.layers.0.mlp.up_proj.weight"].data_ptr() != \
        loaded.state_dict["model.layers.0.mlp.up_proj.weight"].data_ptr()
    torch.testing.assert_close(weights["model.layers.1.self_attn.v_proj.weight"],
                               loaded.state_dict["model.layers.1.self_attn.v_proj.weight"])
    n, bs = 11, 16
    shape = (2, len(plain.layers), 2, bs, plain.num_kv_heads, plain.head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.tensor([[0]], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n)
    ids = torch.randint(0, 1000, (n,))
    cache_a, cache_b = torch.zeros(shape), torch.zeros(shape)
    a = plain.forward(ids, torch.arange(n), meta, cache_a)
    b = fused.forward(ids, torch.arange(n), meta, cache_b)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache_b, cache_a, rtol=1e-4, atol=1e-4)
    # one decode row (the fused path): position n over the n cached tokens
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([n]), block_tables=torch.tensor([[0]], dtype=torch.int32),
        seq_lens=torch.tensor([n + 1], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), max_query_len=1,
        max_seq_len=n + 1)
    a = plain.forward(ids[:1], torch.tensor([n]), meta, cache_a)
    b = fused.forward(ids[:1], torch.tensor([n]), meta, cache_b)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache_b, cache_a, rtol=1e-4, atol=1e-4)


def test_a_gpu_engine_runs_torch_host_ops_on_one_thread_unless_omp_num_threads_is_set(
        monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        one_host_thread()
        assert torch.get_num_threads() == 2  # the user's choice stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        one_host_thread()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
