"""Speculative decoding on the gateway's side: ``--speculative-config`` (vLLM's flag, a JSON
object), /metrics' ``spec_decode_*`` series from the engine's counters, and the acceptance in
the per-turn log line."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from chatgate.cli import build_parser, main, settings_from_args
from chatgate.metrics import Metrics
from chatgate.middleware import tokens_text
from chatgate.turn import TurnStats
from engine import LLM, SamplingParams

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


def test_speculative_config_flag_reaches_the_engine_config() -> None:
    settings = settings_from_args(build_parser().parse_args(
        ["serve", "--speculative-config", SPEC]))
    assert settings.engine.speculative_config == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    off = settings_from_args(build_parser().parse_args(["serve"]))
    assert off.engine.speculative_config is None


def test_bad_speculative_config_flag_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--speculative-config",
                 '{"method": "eagle", "num_speculative_tokens": 3}']) == 2
    assert "method must be 'ngram'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--speculative-config", "ngram"])
    assert e.value.code == 2


def test_spec_decode_series_report_the_engine_counters(tiny_model: str) -> None:
    llm = LLM(tiny_model, num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    metrics = Metrics("tiny", "r0")
    metrics.attach_engine(llm.stats)
    out = llm.generate([list(range(100, 110)) * 4], SamplingParams(temperature=0,
                                                                   max_tokens=24))[0]
    text = generate_latest(metrics.registry).decode()
    got = {s.name: s.value for family in text_string_to_metric_families(text)
           for s in family.samples}
    stats = llm.stats()
    assert stats.spec_decode_num_drafts > 0
    assert got["chatgate:spec_decode_num_drafts_total"] == stats.spec_decode_num_drafts
    drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    assert (out.num_draft_tokens, out.num_accepted_tokens) == (drafted, accepted)
    assert got["chatgate:spec_decode_num_draft_tokens_total"] == drafted
    assert got["chatgate:spec_decode_num_accepted_tokens_total"] == accepted
    assert got["chatgate:spec_decode_draft_acceptance_rate"] == pytest.approx(
        stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens)


def test_turn_log_line_shows_the_acceptance() -> None:
    turn = TurnStats(prompt_tokens=10, completion_tokens=8, draft_tokens=12,
                     accepted_tokens=9)
    assert tokens_text([turn]) == (" prompt=10 cached=0 completion=8"
                                   " spec_accepted=9/12 (75%)")
    assert "spec" not in tokens_text([TurnStats(prompt_tokens=3)])
