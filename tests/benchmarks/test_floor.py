"""The floor model (benchmarks/floor.py): its arithmetic on a hand-computed case, and the order
of its floors on a real model's weights."""

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import floor  # noqa: E402

# 2 layers of 1,000 weights (600 of them the MLP's) at 2 bytes each, lm_head 100 weights at 2
SPLIT = floor.WeightSplit(layers=2, params=1000, bytes_per_param=2.0, mlp_params=600,
                          head_params=100, head_bytes_each=2)
RATES, COPY_BW = (1e5, 1e5), 1e4  # FLOP/s, bytes/s


def test_a_step_of_20_rows_over_2000_kv_bytes_has_the_hand_computed_floors():
    """FLOPs 2 * 20 * (1,000 + 100) / 1e5 = 0.44 s; bytes (2,200 weights + 2,000 KV) / 1e4 =
    0.42 s; serial 0.44 + 0.2 = 0.64 s. Overlap without L2: the MLP (0.24 s FLOP-bound) and
    lm_head (0.04 s) after max(KV 0.2 s, q/k/v and o 0.16 s) = 0.48 s."""
    f = floor.step_floors(SPLIT, 20, 20, 2000.0, SPLIT.weight_bytes, RATES, COPY_BW, 0)
    assert SPLIT.weight_bytes == 2200
    assert f.flop_s == pytest.approx(0.44)
    assert f.floor_s == pytest.approx(0.44)
    assert f.serial_s == pytest.approx(0.64)
    assert f.overlap_s == pytest.approx(0.48)


def test_mlp_weights_resident_in_l2_move_beside_the_kv_reads():
    """300 bytes of L2, in each of the 2 layers, hold half of the MLP's 1,200 bytes: half its
    0.24 s joins the 0.16 s beside the KV reads, 0.12 + 0.04 + max(0.2, 0.28) = 0.44 s; with
    the whole MLP resident the overlap floor is the step's floor, max(FLOPs, bytes)."""
    assert floor.overlap_floor_s(SPLIT, 20, 20, 2000.0, RATES, COPY_BW, 300) == pytest.approx(0.44)
    f = floor.step_floors(SPLIT, 20, 20, 2000.0, SPLIT.weight_bytes, RATES, COPY_BW, 1 << 20)
    assert f.overlap_s == pytest.approx(f.floor_s)


def test_workload_floor_sums_the_floors_of_its_steps_and_divides_by_measured_time():
    """A prefill step of 20 tokens on empty context (0.44 s, FLOP-bound, serial too) and a
    decode step of 2 rows over 100 context tokens of 20 bytes each (FLOPs 0.044 s; bytes
    (2,200 + 2,000) / 1e4 = 0.42 s; serial: weights 0.22 s, then KV 0.2 s)."""
    result = floor.workload_floor(SPLIT, 20, [(20, 0), (2, 100)], [20, 2], output_tokens=22,
                                  seconds=1.72, rates=RATES, copy_bw=COPY_BW, l2_bytes=0)
    assert result["floor_s"] == pytest.approx(0.44 + 0.42)
    assert result["serial_s"] == pytest.approx(0.44 + (0.22 + 0.2))
    assert result["fraction"] == pytest.approx(0.86 / 1.72)
    assert result["output_tokens_per_s"] == pytest.approx(22 / 0.86)
    assert result["floor_s"] <= result["overlap_s"] <= result["serial_s"]


def test_overlap_floor_lies_between_the_flop_floor_and_the_serial_floor(tiny_model):
    """With no KV and no L2 the overlap floor is every GEMM in series (the FLOP floor when each
    is compute-bound); with KV reads, the MLP and lm_head come on top of them; it never exceeds
    the serial floor, and more L2 never raises it."""
    from engine import LLM

    model = LLM(tiny_model, max_model_len=64, num_kv_blocks=8).engine.runner.model
    split = floor.WeightSplit.of(model)
    batch, slow, bw = 256, (1e9, 1e9), 1e12  # FLOP-bound GEMMs
    flop_s = 2 * batch * (floor.layer_params(model) + model.lm_head.numel()) / slow[0]
    assert floor.overlap_floor_s(split, batch, batch, 0, slow, bw, 0) == pytest.approx(flop_s)
    weight_bytes = floor.layer_weight_bytes(model) + model.lm_head.numel() * 4
    for kv_bytes in (0, 1e9, 1e14):
        serial = max(flop_s, weight_bytes / bw) + kv_bytes / bw
        floors = [floor.overlap_floor_s(split, batch, batch, kv_bytes, slow, bw, l2)
                  for l2 in (0, 1 << 10, 1 << 20, 1 << 40)]
        assert all(a >= b * (1 - 1e-12) for a, b in itertools.pairwise(floors))
        assert max(flop_s, kv_bytes / bw) * (1 - 1e-12) <= floors[0] <= serial * (1 + 1e-12)
    down = model.layers[0].down
    mlp_s = 2 * batch * 3 * len(model.layers) * down.numel() / slow[0]
    head_s = 2 * batch * model.lm_head.numel() / slow[0]
    assert floor.overlap_floor_s(split, batch, batch, 1e14, slow, bw, 0) == pytest.approx(
        mlp_s + head_s + 1e14 / bw)
    assert floor.overlap_floor_s(split, batch, batch, 1e14, slow, bw, 1 << 40) == pytest.approx(
        head_s + 1e14 / bw)
