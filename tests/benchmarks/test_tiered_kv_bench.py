"""benchmarks/tiered_kv.py runs end to end in ``--quick`` mode (tiny random Llama): its table
last, its JSON and plot written. Timings are not asserted; the structure is: with the host tier
the returning turns compute less and hit the host tier, and the greedy answers do not change."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "tiered_kv.py"


def test_tiered_kv_quick(tmp_path, tiny_model, capsys):
    spec = importlib.util.spec_from_file_location("bench_tiered_kv", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--model", tiny_model, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    text = (tmp_path / "tiered_kv_quick.txt").read_text()
    for needle in ("returning-turn TTFT p50 (ms)", "prefill tokens computed, all turns",
                   "decode tok/s of other requests", "greedy answers identical"):
        assert needle in text and needle in printed
    raw = json.loads((tmp_path / "tiered_kv_quick.json").read_text())
    on, off = raw["on"], raw["off"]
    assert raw["figures"]["same_answers"] == len(on["answers"]) == len(off["answers"])
    assert on["computed"][0] == off["computed"][0]  # the histories set up: nothing to reuse
    assert sum(on["computed"][1:]) < sum(off["computed"][1:])
    assert on["stats"]["host_cache_hits"] > 0 and off["stats"]["host_cache_hits"] == 0
    assert raw["decode_traffic"]["reloaded_blocks"] > 0
    assert raw["decode_quiet"]["reloaded_blocks"] == 0
    pytest.importorskip("matplotlib")
    assert (tmp_path / "tiered_kv_quick.png").stat().st_size > 0
