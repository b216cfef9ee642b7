"""The repetition guard: an output whose tail is one n-gram repeated ends with finish_reason
``repetition``; other outputs, and requests without the guard, are left alone."""

from hypothesis import given
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.repetition import MAX_NGRAM, MIN_REPEATS, MIN_SPAN, loops

PROMPT = [1, 2, 3]


def ends_in_loop(output: list[int]) -> bool:
    return loops(PROMPT + output, len(output))


def test_a_tail_of_one_token_repeated_over_the_span_is_a_loop() -> None:
    assert ends_in_loop([5, 6] + [7] * MIN_SPAN)
    assert not ends_in_loop([5, 6] + [7] * (MIN_SPAN - 1))


def test_a_short_ngram_repeated_over_the_span_is_a_loop_even_starting_mid_copy() -> None:
    ngram = [10, 11, 12, 13]
    copies = ngram * (MIN_SPAN // len(ngram) + 1)
    assert ends_in_loop([99] + copies[2:2 + MIN_SPAN])
    assert not ends_in_loop([99] + copies[2:1 + MIN_SPAN])


def test_a_long_ngram_needs_its_repeats() -> None:
    ngram = list(range(100, 100 + MAX_NGRAM))
    assert ends_in_loop([7] + ngram * MIN_REPEATS)
    assert not ends_in_loop([7] + ngram * (MIN_REPEATS - 1) + ngram[:-1])


def test_an_ngram_longer_than_the_limit_is_not_a_loop() -> None:
    assert not ends_in_loop(list(range(100, 101 + MAX_NGRAM)) * MIN_REPEATS)


def test_text_that_varies_or_whose_prompt_repeats_is_not_a_loop() -> None:
    assert not ends_in_loop(list(range(200)))
    assert not ends_in_loop([4] * (MIN_SPAN - 1) + [5])
    assert not loops([7] * 100 + [8] * (MIN_SPAN - 1), MIN_SPAN - 1)  # the rest is prompt


def loops_by_definition(token_ids: list[int], num_output_tokens: int) -> bool:
    """Every n-gram length in turn: the tail's last ``max(MIN_SPAN, MIN_REPEATS * n)`` tokens,
    inside the output, each equal to the token ``n`` before it."""
    for n in range(1, MAX_NGRAM + 1):
        span = max(MIN_SPAN, MIN_REPEATS * n)
        if span <= num_output_tokens and all(
                token_ids[-i] == token_ids[-i - n] for i in range(1, span - n + 1)):
            return True
    return False


@given(st.data())
def test_loops_agrees_with_its_definition(data: st.DataObject) -> None:
    vocab = data.draw(st.sampled_from([2, 3, 40]))
    token = st.integers(0, vocab - 1)
    ngram = data.draw(st.lists(token, min_size=1, max_size=MAX_NGRAM + 4))
    head = data.draw(st.lists(token, max_size=40))
    length = data.draw(st.integers(0, 4 * MAX_NGRAM))
    output = (head + ngram * (length // len(ngram) + 1))[:length]
    output[-1:] = data.draw(st.sampled_from([output[-1:], [vocab]]))  # maybe break the tail
    prompt = data.draw(st.lists(token, max_size=8))
    token_ids = prompt + output
    if token_ids:
        assert loops(token_ids, len(output)) == loops_by_definition(token_ids, len(output))


def test_a_looping_answer_ends_with_repetition_and_only_under_the_guard(llm: LLM) -> None:
    prompt = "1, 1, 1, 1, 1, 1, 1, 1,"
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MIN_SPAN + 24)
    guarded = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MIN_SPAN + 24,
                             repetition_guard=True)
    free, cut = (out.outputs[0] for out in llm.generate([prompt, prompt], [greedy, guarded]))
    assert free.finish_reason == "length" and len(free.token_ids) == MIN_SPAN + 24
    assert cut.finish_reason == "repetition"
    assert len(cut.token_ids) == MIN_SPAN and cut.text.startswith(" 1, 1, 1,")
    assert free.token_ids[:MIN_SPAN] == cut.token_ids
