"""A request's life in the engine: what ``step`` returns for it, and that an aborted one is
forgotten (its blocks back in the pool, its id free again)."""

from engine import LLM, SamplingParams

PROMPT = [1, 9690, 314, 253, 1345, 28, 3022, 17]


def _run(llm: LLM) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while llm.engine.has_unfinished():
        for output in llm.engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def test_streamed_request_reports_deltas_and_final_only_once_with_everything() -> None:
    llm = LLM("smollm2", max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.engine.add_request("streamed", PROMPT, params)
    llm.engine.add_request("final", PROMPT, params, final_only=True)
    outputs = _run(llm)
    streamed, (final,) = outputs["streamed"], outputs["final"]
    assert len(streamed) == 12 and final.finished
    assert [len(o.outputs[0].token_ids) for o in streamed] == [1] * 12  # one new token a step
    assert [o.finished for o in streamed] == [False] * 11 + [True]
    assert all(o.prompt_token_ids is None for o in streamed)
    assert final.prompt_token_ids == PROMPT
    assert final.outputs[0].token_ids == [t for o in streamed for t in o.outputs[0].token_ids]
    assert final.outputs[0].text == "".join(o.outputs[0].text for o in streamed) != ""
    assert llm.engine.requests == {}


def test_abort_forgets_the_request_and_frees_its_blocks() -> None:
    llm = LLM("smollm2", max_model_len=256, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    llm.engine.add_request("r", PROMPT, params)
    assert [len(o.outputs[0].token_ids) for _ in range(2) for o in llm.engine.step()] == [1, 1]
    assert llm.stats().num_blocks_used > 0
    aborted = llm.engine.abort("r")
    assert aborted is not None and aborted.finished
    assert aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == []  # both tokens were reported by their steps
    assert "r" not in llm.engine.requests and not llm.engine.has_unfinished()
    assert llm.stats().num_blocks_used == 0
    assert llm.engine.abort("r") is None
    llm.engine.add_request("r", PROMPT, params)  # the id is free again
    assert llm.engine.has_unfinished()
