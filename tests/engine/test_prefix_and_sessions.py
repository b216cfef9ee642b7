"""Prefix caching (tenant-salted) and pinned multi-turn sessions."""

import pytest

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24)

LONG_SYSTEM = (
    "You are the support assistant of Northwind Hardware, a shop that sells tools, fasteners, "
    "paint and garden supplies. Always greet the customer politely, answer in at most three "
    "sentences, never invent prices, and when you do not know an answer, say so and offer to "
    "connect the customer with a human colleague. Opening hours are Monday to Saturday, nine "
    "to six. Returns are accepted within thirty days with a receipt. Delivery is free for "
    "orders above fifty euros. The shop is at 12 Harbour Street. Loyalty members get five "
    "percent off every purchase and early access to seasonal sales. Gift cards never expire. "
    "Do not discuss competitors. Keep a friendly, practical tone and suggest the right tool "
    "for the job when the customer describes a project. Mention the weekly workshop on "
    "Thursday evenings, where staff demonstrate power tools and answer renovation questions. "
    "Parking behind the shop is free for customers for the first hour. Keys can be cut while "
    "you wait, and paint can be mixed to any colour in about ten minutes."
)


def _chat(question: str) -> list[dict]:
    return [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": question}]


def _computed(llm: LLM) -> int:
    return llm.stats().num_tokens_computed


def test_shared_system_prompt_hits_the_prefix_cache(llm: LLM) -> None:
    first = llm.chat(_chat("Do you sell hammers?"), GREEDY)[0]
    assert len(first.prompt_token_ids) >= 210
    before = _computed(llm)
    second = llm.chat(_chat("When are you open on Saturday?"), GREEDY)[0]
    prompt_len = len(second.prompt_token_ids)
    generated = len(second.outputs[0].token_ids)
    assert second.num_cached_tokens >= 192
    # the model computes only the uncached prompt tokens, then one token per generated token
    # (the last sampled token is never fed back)
    assert _computed(llm) - before == prompt_len - second.num_cached_tokens + generated - 1

    uncached = LLM("smollm2", enable_prefix_caching=False)
    reference = uncached.chat(_chat("When are you open on Saturday?"), GREEDY)[0]
    assert reference.num_cached_tokens == 0
    assert reference.outputs[0].token_ids == second.outputs[0].token_ids


def test_cache_salt_isolates_tenants(llm: LLM) -> None:
    def chat(question: str) -> list[dict]:
        return [{"role": "system", "content": "Salted. " + LONG_SYSTEM},
                {"role": "user", "content": question}]

    llm.chat(chat("Can I return a drill without a receipt?"), GREEDY, cache_salt="tenant-a")
    other = llm.chat(chat("Can I return a drill without a receipt?"), GREEDY,
                     cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0
    unsalted = llm.chat(chat("Do you cut keys?"), GREEDY)[0]
    assert unsalted.num_cached_tokens == 0
    same = llm.chat(chat("Do gift cards expire?"), GREEDY, cache_salt="tenant-a")[0]
    assert same.num_cached_tokens >= 192


def test_three_turn_session_computes_only_new_tokens(llm: LLM) -> None:
    questions = ["Name a fruit that is yellow.", "What colour is its inside?",
                 "Write one sentence about it."]
    reference_llm = LLM("smollm2", enable_prefix_caching=False)
    history: list[dict] = [{"role": "system", "content": "You answer briefly."}]
    previous_tokens = 0  # tokens of the previous turn with KV: its prompt + answer − last
    for turn, question in enumerate(questions):
        history.append({"role": "user", "content": question})
        prompt_ids = llm.engine.render_chat(history, "fruit")
        before = _computed(llm)
        out = llm.chat(history, GREEDY, session_id="fruit")[0]
        computed = _computed(llm) - before
        generated = len(out.outputs[0].token_ids)
        assert out.prompt_token_ids == prompt_ids
        prefill = computed - (generated - 1)
        if turn > 0:
            assert out.num_cached_tokens == previous_tokens
            new_tokens = len(prompt_ids) - previous_tokens
            assert prefill == new_tokens
            assert new_tokens <= len(llm.tokenizer.encode(question)) + 12  # template + 1
        # the same token ids, session-less and uncached, give the same answer
        alone = reference_llm.generate([prompt_ids], GREEDY)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        history.append({"role": "assistant", "content": out.outputs[0].text})
        previous_tokens = len(prompt_ids) + generated - 1

    # regenerate the last answer: the history minus that answer is all reused
    regenerate = history[:-1]
    prompt_ids = llm.engine.render_chat(regenerate, "fruit")
    before = _computed(llm)
    again = llm.chat(regenerate, GREEDY, session_id="fruit")[0]
    assert again.num_cached_tokens == len(prompt_ids) - 1
    assert _computed(llm) - before == 1 + len(again.outputs[0].token_ids) - 1
    assert again.outputs[0].text == history[-1]["content"]

    stats = llm.stats()
    assert stats.num_pinned_sessions == 1
    assert llm.unpin_session("fruit")
    stats = llm.stats()
    assert stats.num_pinned_sessions == 0
    assert stats.num_blocks_used == 0


def test_edit_mid_block_copies_instead_of_overwriting(llm: LLM) -> None:
    """Editing the last user message diverges inside a block that the pinned session and the
    prefix cache share: the new turn must not corrupt it (copy-on-write)."""
    base = [{"role": "user", "content": "Tell me a short fact about the moon."}]
    first = llm.chat(base, GREEDY, session_id="edit")[0]
    edited = [{"role": "user", "content": "Tell me a short fact about the sun."}]
    llm.chat(edited, GREEDY, session_id="edit")
    # the first prompt, replayed without the session, still hits and still gives its answer
    replay = llm.chat(base, GREEDY)[0]
    assert replay.outputs[0].token_ids == first.outputs[0].token_ids
    llm.unpin_session("edit")


def test_pins_beyond_budget_are_unpinned_lru_first() -> None:
    llm = LLM("smollm2", num_kv_blocks=64, pin_budget_fraction=0.1)  # 6 pinned blocks
    for name in ["a", "b", "c", "d"]:
        llm.chat([{"role": "user", "content": f"Session {name}: say hello."}],
                 SamplingParams(temperature=0, max_tokens=8), session_id=name)
    pins = {p.session_id: p for p in llm.engine.kv.pinned_sessions()}
    assert list(pins)[-1] == "d"
    assert len(pins) < 4
    assert list(pins) == ["a", "b", "c", "d"][-len(pins):]  # the oldest went first
    assert llm.stats().num_pinned_blocks <= 6


def test_pinned_sessions_are_unpinned_before_running_requests_are_preempted() -> None:
    llm = LLM("smollm2", num_kv_blocks=48, pin_budget_fraction=1.0)
    for name in ["a", "b"]:
        llm.chat([{"role": "user", "content": f"Session {name}: describe a tree in detail."}],
                 SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), session_id=name)
    pinned_before = llm.stats().num_pinned_blocks
    free_before = llm.stats().num_blocks_free
    assert pinned_before > 8
    # a request that needs more than the free blocks: sessions give way, nothing is preempted
    out = llm.generate([[100 + i for i in range(400)]],
                       SamplingParams(temperature=0, max_tokens=240, ignore_eos=True))[0]
    assert 640 / 16 > free_before
    assert len(out.outputs[0].token_ids) == 240
    stats = llm.stats()
    assert stats.num_preemptions == 0
    assert stats.num_pinned_sessions < 2


@pytest.mark.parametrize("session", [None, "s"])
def test_release_returns_every_block(session: str | None) -> None:
    llm = LLM("smollm2", num_kv_blocks=128)
    llm.chat([{"role": "user", "content": "Count to five."}], GREEDY, session_id=session)
    if session is not None:
        assert llm.stats().num_blocks_used > 0
        assert llm.unpin_session(session)
    assert llm.stats().num_blocks_used == 0
    assert llm.stats().num_blocks_free == 128
