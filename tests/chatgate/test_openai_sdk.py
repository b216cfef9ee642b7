"""The official ``openai`` SDK, unchanged, against a real ``chatgate serve``."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
from chatgate_testlib import KEYS

MODEL = "smollm2"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS["alice"], max_retries=0,
                      timeout=120)
    yield c
    c.close()


def msgs(user: str, system: str | None = None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": user}]


def test_models_lists_the_engine_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_stream_equals_non_stream_under_greedy(client, server):
    m = msgs("Name three colors of the rainbow.")
    full = client.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                          max_tokens=24)
    assert full.object == "chat.completion"
    text = full.choices[0].message.content
    assert text and full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens > 0

    stream = client.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                            max_tokens=24, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in chunks[:-1])


def test_repeated_system_prompt_is_cached(client):
    system = f"[{uuid.uuid4().hex}] You are a meticulous assistant who answers briefly. " * 6
    first = client.chat.completions.create(model=MODEL, messages=msgs("Hi!", system),
                                           temperature=0, max_tokens=4)
    second = client.chat.completions.create(model=MODEL, messages=msgs("Hello there!", system),
                                            temperature=0, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert cached >= first.usage.prompt_tokens - 32  # all full blocks of the system prompt


def test_n_2_gives_two_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=msgs("Tell me a word."), n=2,
                                       temperature=1.0, seed=7, max_tokens=8)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    # usage counts both samples
    assert r.usage.completion_tokens >= 2

    s = client.chat.completions.create(model=MODEL, messages=msgs("Tell me a word."), n=2,
                                       temperature=1.0, seed=7, max_tokens=8, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for c in s:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert texts[0] and texts[1]


def test_stop_strings_cut_the_output(client):
    m = msgs("Count from 1 to 20, separated by commas.")
    base = client.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                          max_tokens=40)
    text = base.choices[0].message.content
    assert len(text) > 6, text
    stop = text[4:6]  # a string that occurs in the greedy output
    cut = client.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                         max_tokens=40, stop=[stop, "NEVER-HAPPENS"])
    assert cut.choices[0].finish_reason == "stop"
    out = cut.choices[0].message.content
    assert stop not in out
    assert text.startswith(out)
    assert len(out) < len(text)
    streamed = client.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                              max_tokens=40, stop=stop, stream=True)
    s_text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert s_text == out


def test_max_tokens_ends_with_length(client):
    r = client.chat.completions.create(model=MODEL, messages=msgs("Write a long story."),
                                       temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    r2 = client.chat.completions.create(model=MODEL, messages=msgs("Write a long story."),
                                        temperature=0, max_completion_tokens=3)
    assert r2.choices[0].finish_reason == "length"
    assert r2.usage.completion_tokens == 3


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model=MODEL, messages=msgs("Say something random."), temperature=1.0,
              top_p=0.9, max_tokens=12, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_top_k_extension_and_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=msgs("Say yes."), temperature=0, max_tokens=4, logprobs=True,
        top_logprobs=3, extra_body={"top_k": 1})
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    for entry in lp:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    # greedy: the sampled token is the most likely one
    assert lp[0].token == lp[0].top_logprobs[0].token
    # the tokens' raw bytes spell the content
    assert b"".join(bytes(e.bytes) for e in lp).decode() == r.choices[0].message.content

    s = client.chat.completions.create(
        model=MODEL, messages=msgs("Say yes."), temperature=0, max_tokens=4, logprobs=True,
        top_logprobs=2, stream=True)
    entries = [e for c in s if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert [e.token for e in entries] == [e.token for e in lp]


def test_wire_format_is_plain_sse(server):
    """Byte level: ``data: {json}\\n\\n`` events ending with ``data: [DONE]``."""
    body = {"model": MODEL, "messages": msgs("Hi"), "max_tokens": 3, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    events = [e for e in raw.split("\n\n") if e.strip() and not e.startswith(":")]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_client_sent_cache_salt_is_ignored(client):
    """A client cannot pick its salt: a salt in the body changes nothing."""
    system = f"[{uuid.uuid4().hex}] You are terse. " * 10
    client.chat.completions.create(model=MODEL, messages=msgs("a", system), max_tokens=1,
                                   temperature=0, extra_body={"cache_salt": "one"})
    r = client.chat.completions.create(model=MODEL, messages=msgs("b", system), max_tokens=1,
                                       temperature=0, extra_body={"cache_salt": "two"})
    assert r.usage.prompt_tokens_details.cached_tokens > 0
