"""Smoke tests: every benchmark script runs end to end in its ``--quick`` mode (tiny inputs, a
tiny random-weight Llama with SmolLM2's tokenizer), prints its final table and writes its raw
output and plots. No timing is asserted: these only keep the scripts from rotting."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _check(out: Path, stem: str, capsys, *needles: str) -> str:
    text = (out / f"{stem}.txt").read_text()
    printed = capsys.readouterr().out
    for needle in needles:
        assert needle in text, needle
        assert needle in printed, needle
    assert (out / f"{stem}.json").is_file()
    return text


def test_memory_quick(tmp_path, tiny_model, capsys):
    assert _load("memory").main(["--quick", "--model", tiny_model, "--out", str(tmp_path)]) == 0
    text = _check(tmp_path, "memory_quick", capsys, "(a) ours: paged",
                  "(b) contiguous max_model_len", "engine == simulator step for step: True")
    raw = json.loads((tmp_path / "memory_quick.json").read_text())
    a, b, _ = raw["summaries"]
    # structural facts, not timings: paging never reserves a whole max_model_len per request
    assert a["waste_at_peak"] < b["waste_at_peak"]
    assert a["max_in_flight"] > b["max_in_flight"]
    assert "waste@peak" in text.splitlines()[-9] or "waste@peak" in text
    pytest.importorskip("matplotlib")
    assert (tmp_path / "memory_waste_quick.png").stat().st_size > 0
    assert (tmp_path / "memory_inflight_quick.png").stat().st_size > 0


def test_prefix_quick(tmp_path, tiny_model, capsys):
    assert _load("prefix").main(["--quick", "--model", tiny_model, "--out", str(tmp_path)]) == 0
    _check(tmp_path, "prefix_quick", capsys, "shared system prompt", "multi-turn")
    raw = json.loads((tmp_path / "prefix_quick.json").read_text())
    on, off = raw["shared"]["on"], raw["shared"]["off"]
    assert sum(on["prefill"]) < sum(off["prefill"])
    s = raw["turns"]["sessions"]
    for computed, new in zip(s["computed"][1:], s["new"][1:], strict=True):
        assert new <= computed <= new + 1


def test_throughput_quick(tmp_path, tiny_model, capsys):
    mod = _load("throughput")
    assert mod.main(["--quick", "--model", tiny_model, "--out", str(tmp_path)]) == 0
    text = _check(tmp_path, "throughput_quick", capsys, "output tokens/s (wall)")
    assert "engine / transformers" in text
    raw = json.loads((tmp_path / "throughput_quick.json").read_text())
    assert raw["runs"]["engine"][0]["useful_tokens"] == raw["runs"]["transformers"][0][
        "useful_tokens"]


def test_serving_quick(tmp_path, tiny_model, capsys):
    mod = _load("serving")
    assert mod.main(["--quick", "--model", tiny_model, "--out", str(tmp_path)]) == 0
    _check(tmp_path, "serving_quick", capsys, "out tok/s", "TTFT p99 s")
    raw = json.loads((tmp_path / "serving_quick.json").read_text())
    (level,) = raw["results"]["chatgate"]
    assert level["errors"] == 0 and level["output_tokens"] > 0


def test_gpu_e2e_cpu_smoke(tmp_path, tiny_model, capsys, monkeypatch):
    """The H200 script's own code path on CPU: both correctness checks (float32 tokens must be
    equal: the oracle), transformers against itself, every transformers batch timed."""
    mod = _load("gpu_e2e")
    monkeypatch.setenv("OUT", str(tmp_path))
    mod.main(["--device", "cpu", "--model", tiny_model, "--dtype", "bfloat16", "--quick",
              "--num-requests", "6", "--correct-prompts", "2", "--correct-tokens", "4",
              "--hf-candidates", "4"])
    printed = capsys.readouterr().out
    assert "correctness (float32): 2/2 prompts x 4 tokens equal" in printed
    assert "transformers bfloat16 as one left-padded batch vs one prompt at a time" in printed
    assert "transformers (b=4)" in printed and "(all batches; eager)" in printed
    raw = json.loads((tmp_path / "gpu_e2e.json").read_text())
    hf = raw["hf_throughput"]
    assert (hf["batch_size"], hf["batches_timed"], hf["all_batches"]) == (4, 2, True)
    assert hf["useful_output_tokens"] == raw["engine_throughput"]["output_tokens"]
    assert raw["correctness"]["bfloat16"]["fp32_reference"]["engine"]["steps"] == 8
    pytest.importorskip("matplotlib")
    assert (tmp_path / "gpu_e2e.png").stat().st_size > 0


def test_gpu_serving_quick(tmp_path, tiny_model, capsys):
    """The serving benchmark's every path on CPU: direct, SSE and WebSocket through a real
    ``chatgate serve`` with one and with two front-end processes, each streaming every token and
    groups of 3, and the multi-turn run with and without session_id; every request gets its
    tokens, in fewer chunks with groups."""
    mod = _load("gpu_serving")
    assert mod.main(["--quick", "--device", "cpu", "--dtype", "float32", "--models",
                     tiny_model, "--api-server-count", "1,2", "--stream-interval", "1,3",
                     "--out", str(tmp_path)]) == 0
    _check(tmp_path, "gpu_serving", capsys, "/direct", "ITL p50 ms", "multi-turn",
           "ratio to direct")
    raw = json.loads((tmp_path / "gpu_serving.json").read_text())
    paths = {(lv["path"], lv["concurrency"]) for lv in raw["levels"]}
    assert paths == {(p + v, c) for p in ("sse", "ws") for v in ("", " i3", " x2", " x2 i3")
                     for c in (1, 3)} | {("direct", 1), ("direct", 3)}
    assert all(lv["errors"] == 0 and lv["tokens"] == 6 * 4 for lv in raw["levels"])
    chunk_tokens = {lv["path"]: lv["tokens_per_chunk"] for lv in raw["levels"]
                    if lv["concurrency"] == 1}
    assert chunk_tokens["sse i3"] > chunk_tokens["sse"]
    assert chunk_tokens["ws i3"] > chunk_tokens["ws"]
    # the engine's loop, counted on every path (NaN fails these)
    assert all(lv["engine_ms_per_step"] > 0 and 0 < lv["engine_prompt_share"] <= 1
               for lv in raw["levels"])
    assert all(lv["engine_busy"] > 0 for lv in raw["levels"] if lv["path"] != "direct")
    turns = raw["multi_turn"][tiny_model]
    assert turns["session_id"]["errors"] == turns["no session_id"]["errors"] == 0
    pytest.importorskip("matplotlib")
    assert (tmp_path / "gpu_serving.png").stat().st_size > 0


def test_gpu_serving_step_profile_reads_each_levels_steps_from_the_server_log(
        tmp_path, tiny_model, capsys):
    """``--step-profile``: the server logs its steps at debug level and every served level
    gets its decode steps' count, time and sections; ``--server-args`` reach the server."""
    mod = _load("gpu_serving")
    assert mod.main(["--quick", "--device", "cpu", "--dtype", "float32", "--models",
                     tiny_model, "--no-direct", "--turns-sessions", "0", "--step-profile",
                     "--server-args=--admission-batch 1", "--out", str(tmp_path)]) == 0
    raw = json.loads((tmp_path / "gpu_serving.json").read_text())
    assert raw["levels"] and all(lv["errors"] == 0 for lv in raw["levels"])
    for level in raw["levels"]:
        decode = level["steps"]["decode"]
        assert decode["steps"] >= 1 and decode["ms"] > 0 and decode["forward"] > 0
    assert "decode steps:" in capsys.readouterr().out
    args = mod.parse_args(["--step-profile", "--server-args=--admission-batch 1"])
    assert mod.engine_flags("m", args)[-4:] == ["--log-level", "debug", "--admission-batch", "1"]


def test_gpu_serving_passes_a_relative_tokenizer_folder_to_servers_in_other_folders(
        tmp_path, monkeypatch) -> None:
    """A ``--code`` server runs in its own folder: the tokenizer folder it gets is absolute."""
    mod = _load("gpu_serving")
    monkeypatch.chdir(tmp_path)
    flags = mod.engine_flags("m", mod.parse_args(["--tokenizer", "tok"]))
    assert flags[flags.index("--tokenizer") + 1] == str(tmp_path / "tok")


def test_soak_quick(tmp_path, tiny_model, capsys):
    assert _load("soak").main(["--quick", "--model", tiny_model, "--out", str(tmp_path)]) == 0
    _check(tmp_path, "soak", capsys, "KV blocks in use after the load and every session "
           "deleted: 0")


def test_structured_quick(tmp_path, tiny_model, capsys):
    pytest.importorskip("xgrammar")
    assert _load("structured").main(["--quick", "--model", tiny_model, "--out",
                                     str(tmp_path)]) == 0
    _check(tmp_path, "structured_quick", capsys, "(a) JSON schema", "vs (b)")


def test_quantization_quick(tmp_path, tiny_model, capsys):
    assert _load("quantization").main(["--quick", "--model", tiny_model, "--out",
                                       str(tmp_path)]) == 0
    text = _check(tmp_path, "quantization_quick", capsys, "argmax = float32", "batch 1 tok/s",
                  "perplexity")
    assert "int8" in text and "int4" in text
    raw = json.loads((tmp_path / "quantization_quick.json").read_text())
    assert raw["results"]["float32"]["argmax_agreement"] == 1.0
    assert all(r["perplexity"] > 1.0 for r in raw["results"].values())


def test_tensor_parallel_quick(tmp_path, tiny_model, capsys):
    """Two Gloo ranks on the CPU: the float32 greedy tokens of one rank, and the table."""
    mod = _load("tensor_parallel")
    assert mod.main(["--quick", "--device", "cpu", "--dtype", "float32", "--model", tiny_model,
                     "--out", str(tmp_path)]) == 0
    _check(tmp_path, "tensor_parallel_quick", capsys, "float32 greedy = 1 rank",
           "decode step batch 1 (ms): 2 ranks / 1", "throughput, 2 ranks (tok/s)")
    raw = json.loads((tmp_path / "tensor_parallel_quick.json").read_text())
    assert raw["correctness"] == {"equal": 2, "prompts": 2}
    assert raw["throughput"]["output_tokens"] > 0


def test_kv_cache_dtype_scores_both_caches_along_one_path(tmp_path, tiny_model, capsys,
                                                          monkeypatch):
    """The FP8 KV benchmark on CPU: twice the blocks, and both caches' tokens scored at the same
    positions (one request per position of the bf16 cache's greedy path)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    _load("kv_cache_dtype").main(["--device", "cpu", "--model", tiny_model, "--num-requests",
                                  "0", "--prompts", "2", "--tokens", "4"])
    assert "(8 positions, one path)" in capsys.readouterr().out
    runs = json.loads((tmp_path / "kv_cache_dtype.json").read_text())["runs"]
    assert runs["fp8"]["num_blocks"] >= 2 * runs["auto"]["num_blocks"]
    assert runs["auto"]["fp32_steps"] == runs["fp8"]["fp32_steps"] == 8
    assert all(0 <= run["fp32_argmax"] <= 1 for run in runs.values())


def test_spec_decode_quick(tmp_path, tiny_model, capsys):
    argv = ["--quick", "--model", tiny_model, "--quantization", "none", "--out", str(tmp_path),
            "--workloads", "edit,prose,batch,lossless", "--verify-model", tiny_model]
    assert _load("spec_decode").main(argv) == 0
    _check(tmp_path, "spec_decode_quick", capsys, "decode ratio", "lossless:", "verify K=8")
    raw = json.loads((tmp_path / "spec_decode_quick.json").read_text())
    assert raw["lossless"]["mismatches"] == []  # float32 on the CPU: token for token
