"""Grammar-constrained decoding (xgrammar) in the engine: every sample is valid JSON for its
schema, with n > 1, seeds, and under preemption by recompute; tokens drawn unmasked and checked
by the grammar are those that masked draws give."""

import json
import sys

import pytest
import torch

from engine import LLM, SamplingParams
from engine.structured import (
    MAX_REJECTIONS_IN_A_ROW,
    GrammarCompiler,
    SampleGrammar,
    StructuredOutput,
)

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "year": {"type": "integer", "minimum": 0,
                                                    "maximum": 3000}},
          "required": ["name", "year"], "additionalProperties": False}
PROMPTS = [[{"role": "user", "content": f"Describe {who} as JSON with name and year."}]
           for who in ("Ada Lovelace", "Alan Turing", "Grace Hopper", "Marie Curie")]


def check(outputs) -> None:
    for out in outputs:
        for c in out.outputs:
            value = json.loads(c.text)
            assert set(value) == {"name", "year"} and isinstance(value["year"], int), c.text
            assert c.finish_reason == "stop"


def test_every_sample_matches_the_schema(llm: LLM) -> None:
    params = SamplingParams(temperature=0.7, seed=1, n=3, max_tokens=120,
                            structured=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    check(llm.chat(PROMPTS, params))


def test_json_object_mode_and_greedy(llm: LLM) -> None:
    prompt = [{"role": "user", "content": "Reply with a JSON object whose only key is 'ok', "
                                          "set to true."}]
    outs = llm.chat([prompt], SamplingParams(temperature=0.0, max_tokens=300,
                                             structured=StructuredOutput(json_object=True)))
    assert outs[0].outputs[0].finish_reason == "stop"
    assert isinstance(json.loads(outs[0].outputs[0].text), dict)


def test_constrained_requests_survive_preemption() -> None:
    small = LLM("smollm2", num_kv_blocks=24, max_model_len=512)
    params = SamplingParams(temperature=0.7, seed=2, max_tokens=120,
                            structured=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    check(small.chat(PROMPTS * 2, params))
    assert small.stats().num_preemptions > 0


def test_a_bad_specification_is_refused() -> None:
    with pytest.raises(ValueError):
        StructuredOutput()
    with pytest.raises(ValueError):
        StructuredOutput(json_schema="{not json")


def test_rows_without_a_grammar_are_not_masked_by_their_neighbours(llm: LLM) -> None:
    """A batch of constrained and free rows: the free rows' greedy tokens are those they get
    alone, and the constrained rows are still valid (masks go to their rows only)."""
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=120,
                                 structured=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    alone = [llm.chat([p], free)[0].outputs[0].token_ids for p in (PROMPTS[0], PROMPTS[2])]
    mixed = llm.chat(PROMPTS, [free, constrained, free, constrained])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    check([mixed[1], mixed[3]])


def test_masks_follow_recorded_tokens_and_leave_other_rows_alone(llm: LLM) -> None:
    """A mask is filled after the matcher took the tokens recorded for it, and is the mask that
    matcher gives on its own; a row without a matcher, and a row whose matcher has just taken
    its grammar's stop token, stay as they are; the interpreter's GIL switch interval is the
    same after a mask job as before."""
    tok = llm.tokenizer
    brace = tok.encode("{", add_special_tokens=False)[0]
    pair = tok.encode("{}", add_special_tokens=False)[0]
    grammars = GrammarCompiler(tok, llm.engine.vocab_size, torch.device("cpu"))
    spec = StructuredOutput(json_object=True)
    opened, fresh, ended = grammars.matcher(spec), grammars.matcher(spec), grammars.matcher(spec)
    interval = sys.getswitchinterval()
    grammars.accept([opened, ended], [brace, pair])
    grammars.accept([ended], [tok.eos_token_id])  # "{}" then the stop token: it has ended
    logits = torch.zeros(4, llm.engine.vocab_size)
    grammars.apply(grammars.masks([opened, None, fresh, ended]), logits)
    allowed = logits > float("-inf")
    assert not allowed[0, brace] and allowed[2, brace]  # "{" opened row 0 only
    assert allowed[2].sum() < logits.shape[1] / 10  # a fresh object allows few tokens
    assert allowed[1].all() and allowed[3].all()
    assert sys.getswitchinterval() == interval
    # the constrained rows are exactly what each matcher allows on its own
    import xgrammar as xgr

    for row, tokens in ((0, [brace]), (2, [])):
        alone = grammars.matcher(spec)
        for token in tokens:
            assert alone.accept_token(token)
        bitmask = xgr.allocate_token_bitmask(1, llm.engine.vocab_size)
        alone.fill_next_token_bitmask(bitmask)
        expected = torch.zeros(1, llm.engine.vocab_size)
        xgr.apply_token_bitmask_inplace(expected, bitmask)
        assert torch.equal(allowed[row], expected[0] > float("-inf"))


@pytest.mark.parametrize("overlapped", [False, True], ids=["synchronous", "overlapped"])
def test_checked_draws_give_the_tokens_of_masked_draws(overlapped: bool) -> None:
    """Greedy, seeded and unseeded temperature rows: drawn unmasked and checked by their
    grammars (a rejected token drawn again under the mask, from the same noise), the tokens
    are those of draws masked first; the checks both accepted and rejected tokens, and every
    output is valid."""
    llm = LLM("smollm2", max_model_len=1024, num_kv_blocks=256, async_scheduling=overlapped)
    spec = StructuredOutput(json_schema=json.dumps(SCHEMA))
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.8,
                             seed=i if i % 3 == 1 else None, max_tokens=120, structured=spec)
              for i in range(9)]
    tokens = {}
    for checks in (False, True):
        llm.engine.check_grammar_draws = checks
        torch.manual_seed(0)  # the unseeded rows' noise keys
        outs = llm.chat(PROMPTS * 2 + PROMPTS[:1], params)
        check(outs)
        tokens[checks] = [o.outputs[0].token_ids for o in outs]
        assert llm.engine.kv.pool.num_used == 0
    assert tokens[True] == tokens[False]
    grammars = llm.engine._grammars()
    assert 0 < grammars.num_rejected < grammars.num_checked


def test_truncated_samples_are_masked_before_every_draw(llm: LLM) -> None:
    """With top-p, masking first changes which tokens the draw keeps, so no token is checked
    after its draw; the output is still valid."""
    grammars = llm.engine._grammars()
    before = grammars.num_checked
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=120,
                            structured=StructuredOutput(json_schema=json.dumps(SCHEMA)))
    check(llm.chat(PROMPTS[:2], params))
    assert grammars.num_checked == before


def test_rejected_checks_mask_the_next_draws_first_for_longer_and_then_for_good() -> None:
    assert MAX_REJECTIONS_IN_A_ROW == 4
    grammar = SampleGrammar(matcher=None, checkable=True)

    def masked_stretch() -> int:
        n = 0
        while not grammar.checks_next_draw():
            n += 1
        return n

    assert masked_stretch() == 0
    grammar.checked(False)
    assert masked_stretch() == 1
    grammar.checked(True)  # an accepted check starts over
    grammar.checked(False)
    assert masked_stretch() == 1
    for stretch in (2, 4):
        grammar.checked(False)
        assert masked_stretch() == stretch
    grammar.checked(False)  # the fourth in a row
    assert not any(grammar.checks_next_draw() for _ in range(1000))
    assert not SampleGrammar(matcher=None, checkable=False).checks_next_draw()
