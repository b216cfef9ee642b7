"""``benchmarks/everyday_questions.py``: its checkers and loop detector, and a smoke run on two
questions with a tiny random-weight Llama (no figures asserted: it only must not rot)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "everyday_questions.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_everyday_questions", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def test_the_loop_detector_wants_a_tail_filled_by_one_repeated_ngram(bench) -> None:
    window, longest = bench.LOOP_WINDOW, bench.LOOP_MAX_PERIOD
    assert bench.loop_period(list(range(10)) + [7, 8, 9] * window) == 3
    assert bench.loop_period([5] * window) == 1
    assert bench.loop_period(list(range(longest)) * 4) == longest
    assert bench.loop_period(list(range(longest + 1)) * 4) is None  # an n-gram too long
    assert bench.loop_period([1, 2] * (window // 2 - 1)) is None  # shorter than the window
    assert bench.loop_period([1, 2] * window + [3]) is None  # the tail breaks the period


def test_every_question_is_checked_case_insensitively(bench) -> None:
    france, code = bench.QUESTIONS[0], bench.QUESTIONS[-3]
    assert france.is_correct("The capital of France is PARIS.")
    assert not france.is_correct("L'Étoile, la France, la France")
    assert code.is_correct("def add(a, b):\n    return a + b")
    assert len(bench.QUESTIONS) == 30


def test_a_quick_run_writes_its_tables_and_raw_answers(bench, tmp_path, tiny_model,
                                                         capsys) -> None:
    assert bench.main(["--quick", "--model", tiny_model, "--quantizations", "none,int4",
                       "--seeds", "greedy,0", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    text = (tmp_path / "everyday_questions_quick.txt").read_text()
    for needle in ("## summary", "greedy correct", "tok/s offline", "capital of France"):
        assert needle in text and needle in printed, needle
    raw = json.loads((tmp_path / "everyday_questions_quick.json").read_text())
    assert set(raw["summaries"]) == {"none", "int4"}
    assert all(len(answers) == 2 * 2 for answers in raw["answers"].values())
    assert raw["summaries"]["int4"]["questions"] == 2
    pytest.importorskip("matplotlib")
    assert (tmp_path / "everyday_questions_quick.png").stat().st_size > 0
