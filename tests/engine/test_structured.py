"""Grammar-constrained decoding (xgrammar) in the engine: every sample is valid JSON for its
schema, with n > 1, seeds, and under preemption by recompute."""

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.structured import GrammarCompiler
from engine.structured_output import StructuredOutput

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
    its grammar's stop token, stay as they are."""
    tok = llm.tokenizer
    brace = tok.encode("{", add_special_tokens=False)[0]
    pair = tok.encode("{}", add_special_tokens=False)[0]
    grammars = GrammarCompiler(tok, llm.engine.vocab_size, torch.device("cpu"))
    spec = StructuredOutput(json_object=True)
    opened, fresh, ended = grammars.matcher(spec), grammars.matcher(spec), grammars.matcher(spec)
    grammars.accept([opened, ended], [brace, pair])
    grammars.accept([ended], [tok.eos_token_id])  # "{}" then the stop token: it has ended
    logits = torch.zeros(4, llm.engine.vocab_size)
    grammars.apply(grammars.masks([opened, None, fresh, ended]), logits)
    allowed = logits > float("-inf")
    assert not allowed[0, brace] and allowed[2, brace]  # "{" opened row 0 only
    assert allowed[2].sum() < logits.shape[1] / 10  # a fresh object allows few tokens
    assert allowed[1].all() and allowed[3].all()
    # the constrained rows are exactly what each matcher allows on its own
    import xgrammar as xgr

    for row, tokens in ((0, [brace]), (2, [])):
        alone = xgr.GrammarMatcher(grammars._compile(spec))
        for token in tokens:
            assert alone.accept_token(token)
        bitmask = xgr.allocate_token_bitmask(1, llm.engine.vocab_size)
        alone.fill_next_token_bitmask(bitmask)
        expected = torch.zeros(1, llm.engine.vocab_size)
        xgr.apply_token_bitmask_inplace(expected, bitmask)
        assert torch.equal(allowed[row], expected[0] > float("-inf"))


def test_masks_of_more_rows_than_the_first_shared_bitmask_holds_are_filled(llm: LLM) -> None:
    """Past the 64 rows the grammar worker's first bitmask holds, a larger one is shared with
    it: every row of 150 gets its matcher's mask, and dropped matchers leave the rest alone."""
    tok = llm.tokenizer
    brace = tok.encode("{", add_special_tokens=False)[0]
    grammars = GrammarCompiler(tok, llm.engine.vocab_size, torch.device("cpu"))
    spec = StructuredOutput(json_object=True)
    try:
        for rows in (3, 150):
            matchers = [grammars.matcher(spec) for _ in range(rows)]
            grammars.accept(matchers[::2], [brace] * len(matchers[::2]))  # even rows opened
            logits = torch.zeros(rows, llm.engine.vocab_size)
            grammars.apply(grammars.masks(matchers), logits)
            allowed = logits > float("-inf")
            assert not allowed[::2, brace].any() and allowed[1::2, brace].all()
            assert (allowed.sum(1) < logits.shape[1] / 10).all()
            del matchers  # dropped: the worker forgets them with the next job
    finally:
        grammars.close()


def test_masks_reserve_the_padded_rows_a_graph_draw_reads(llm: LLM) -> None:
    """``padded_rows`` makes the shared bitmask hold a CUDA graph's padded batch: the masks'
    rows are its first ones, and asking the worker for the padded rows keeps that bitmask
    (no larger one replaces it under the draw)."""
    grammars = GrammarCompiler(llm.tokenizer, llm.engine.vocab_size, torch.device("cpu"))
    spec = StructuredOutput(json_object=True)
    try:
        matchers = [grammars.matcher(spec) for _ in range(70)]
        masks = grammars.masks(matchers, padded_rows=72)
        masks.result()
        assert masks.bitmask.shape[0] == 70
        padded = grammars.start().bitmask(72)
        assert padded.data_ptr() == masks.bitmask.data_ptr()
        assert torch.equal(padded[:70], masks.bitmask)
    finally:
        grammars.close()


def test_a_grammar_worker_started_ahead_serves_the_first_structured_request() -> None:
    """``start_grammar_worker`` (the engine process calls it at start) starts the worker before
    any structured request; the first one is served by that worker."""
    llm = LLM("smollm2", max_model_len=512, num_kv_blocks=64)
    llm.engine.start_grammar_worker()
    worker = llm.engine.grammars.compiler._worker
    assert worker is not None and worker.exit_code is None
    out = llm.chat([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=120,
                                                structured=StructuredOutput(
                                                    json_schema=json.dumps(SCHEMA))))
    check(out)
    assert llm.engine.grammars.compiler._worker is worker
