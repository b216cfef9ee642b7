"""Text made on the client side (``engine.output_text``) equals, delta for delta, the text the
engine makes itself: samples ended by EOS, a stop token, their length or the repetition guard;
forks (n > 1); many-byte characters split across tokens; outputs merged for a slow reader."""

import dataclasses

import msgspec
import pytest

from engine import LLM, SamplingParams
from engine.output_text import OutputText
from engine.outputs import RequestOutput, merge_outputs
from tests.engine.conftest import conversations

PERIOD = "."


def _params(llm: LLM) -> list[SamplingParams]:
    period = llm.tokenizer.convert_tokens_to_ids(PERIOD)
    return [
        SamplingParams(temperature=0, max_tokens=48),  # EOS or length
        SamplingParams(temperature=0.9, seed=3, max_tokens=40, n=2),  # forks
        SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[period]),
        SamplingParams(temperature=1.0, seed=5, max_tokens=48, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=64, repetition_guard=True,
                       presence_penalty=-2.0),
    ]


def _deltas(llm: LLM, params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    """Every delta output of each request, the same requests run in the same order."""
    engine = llm.engine
    prompts = [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                                 return_dict=False) for c in conversations()]
    for i, prompt in enumerate(prompts):
        for j, p in enumerate(params):
            engine.add_request(f"{i}-{j}", prompt, p)
    deltas: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            deltas.setdefault(output.request_id, []).append(output)
    return deltas


@pytest.fixture(scope="module")
def engine_and_client_deltas(llm: LLM) -> tuple[dict, dict, list[SamplingParams]]:
    params = _params(llm)
    with_text = _deltas(llm, params)
    ids_only = _deltas(llm, [dataclasses.replace(p, detokenize=False) for p in params])
    return with_text, ids_only, params


def _copy(delta: RequestOutput) -> RequestOutput:
    return msgspec.structs.replace(
        delta, outputs=[msgspec.structs.replace(c, token_ids=list(c.token_ids))
                        for c in delta.outputs])


def _texts(deltas: list[RequestOutput]) -> list[list[tuple[int, str]]]:
    return [[(c.index, c.text) for c in d.outputs] for d in deltas]


def test_the_engine_sends_no_text_when_asked_for_ids_only(engine_and_client_deltas) -> None:
    with_text, ids_only, _ = engine_and_client_deltas
    assert any(c.text for ds in with_text.values() for d in ds for c in d.outputs)
    assert all(c.text == "" for ds in ids_only.values() for d in ds for c in d.outputs)


def test_client_text_equals_the_engines_text_delta_for_delta(
        llm: LLM, engine_and_client_deltas) -> None:
    with_text, ids_only, params = engine_and_client_deltas
    eos = llm.engine.info.eos_token_ids
    reasons = set()
    for request_id, sent in ids_only.items():
        deltas = [_copy(d) for d in sent]
        expected = with_text[request_id]
        assert [[c.token_ids for c in d.outputs] for d in deltas] == \
            [[c.token_ids for c in d.outputs] for d in expected]  # the same run twice
        text = OutputText(llm.tokenizer, params[int(request_id.split("-")[1])], eos)
        for delta in deltas:
            text.fill(delta)
        assert _texts(deltas) == _texts(expected), request_id
        reasons.update((c.finish_reason, type(c.stop_reason).__name__)
                       for d in deltas for c in d.outputs if c.finish_reason)
    # every way a sample ends here was exercised
    assert {("stop", "NoneType"), ("stop", "int"), ("length", "NoneType"),
            ("repetition", "NoneType")} <= reasons


def test_client_text_of_merged_deltas_equals_the_engines_whole_text(
        llm: LLM, engine_and_client_deltas) -> None:
    with_text, ids_only, params = engine_and_client_deltas
    for request_id, deltas in ids_only.items():
        merged = RequestOutput(request_id, [])
        for delta in deltas[:3]:  # a reader that fell three steps behind
            merge_outputs(merged, _copy(delta))
        text = OutputText(llm.tokenizer, params[int(request_id.split("-")[1])],
                          llm.engine.info.eos_token_ids)
        text.fill(merged)
        later = [_copy(d) for d in deltas[3:]]
        for delta in later:
            text.fill(delta)
        whole: dict[int, str] = {}
        for delta in [merged, *later]:
            for c in delta.outputs:
                whole[c.index] = whole.get(c.index, "") + c.text
        expected: dict[int, str] = {}
        for delta in with_text[request_id]:
            for c in delta.outputs:
                expected[c.index] = expected.get(c.index, "") + c.text
        assert whole == expected, request_id
