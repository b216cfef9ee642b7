"""The official ``openai`` SDK, unchanged, against a real ``chatgate serve``."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest
from chatgate_testlib import KEYS

MODEL = "smollm2"


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
    # the same prompt was just answered: every full block before the last token is cached
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
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


def test_frequency_penalty_changes_greedy_output(client):
    # a prompt the model answers by repeating: greedy echoes "hello" over and over
    m = msgs("Repeat after me: hello hello hello hello hello hello hello hello hello hello")
    plain = client.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                           max_tokens=32)
    penalised = client.chat.completions.create(model=MODEL, messages=m, temperature=0,
                                               max_tokens=32, frequency_penalty=2.0)
    text, other = plain.choices[0].message.content, penalised.choices[0].message.content
    assert text.lower().count("hello") > other.lower().count("hello")


def test_logit_bias_and_min_tokens(client):
    from engine.loader import load_tokenizer

    banana = load_tokenizer("smollm2").encode(" banana", add_special_tokens=False)
    assert len(banana) == 1
    r = client.chat.completions.create(model=MODEL, messages=msgs("Say hi."), temperature=0,
                                       max_tokens=3, logit_bias={str(banana[0]): 100})
    assert r.choices[0].message.content == " banana" * 3
    short = client.chat.completions.create(model=MODEL, messages=msgs("Say only: OK"),
                                           temperature=0, max_tokens=40)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = client.chat.completions.create(model=MODEL, messages=msgs("Say only: OK"),
                                            temperature=0, max_tokens=40,
                                            extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("prediction", {"type": "content", "content": "Hi"}),
])
def test_unimplemented_openai_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs("Hi"), max_tokens=2,
                                       extra_body={field: value})
    assert e.value.body["code"] == "unsupported_parameter" and e.value.body["param"] == field



COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def offline_greedy() -> dict[str, tuple[list[int], str]]:
    """``LLM.generate`` greedy outputs (token ids, text) for ``COMPLETION_PROMPTS``, with the
    weights ``chatgate serve`` defaults to (``--quantization auto``)."""
    from engine import LLM, SamplingParams

    llm = LLM("smollm2", max_model_len=1024, num_kv_blocks=256, quantization="auto")
    outs = llm.generate(COMPLETION_PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    ids = [llm.engine.tokenizer.encode(p, add_special_tokens=False) for p in COMPLETION_PROMPTS]
    return {p: (i, o.outputs[0].text)
            for p, i, o in zip(COMPLETION_PROMPTS, ids, outs, strict=True)}


def test_completions_equal_llm_generate_for_text_and_token_ids(client, offline_greedy):
    for prompt, (ids, text) in offline_greedy.items():
        for as_sent in (prompt, ids):
            r = client.completions.create(model=MODEL, prompt=as_sent, max_tokens=12,
                                          temperature=0)
            assert r.object == "text_completion" and r.choices[0].text == text
            assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    batch = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS, max_tokens=12,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [offline_greedy[p][1] for p in COMPLETION_PROMPTS]


def test_streamed_completions_equal_the_json_ones(client, offline_greedy):
    stream = client.completions.create(model=MODEL, prompt=COMPLETION_PROMPTS, max_tokens=12,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert [texts[0], texts[1]] == [offline_greedy[p][1] for p in COMPLETION_PROMPTS]
    assert finish == {0: "length", 1: "length"} and usage.completion_tokens == 24


@pytest.mark.parametrize("field,value", [("echo", True), ("suffix", "x"), ("logprobs", 2),
                                         ("best_of", 3)])
def test_unimplemented_completion_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  extra_body={field: value})
    assert e.value.body["code"] == "unsupported_parameter" and e.value.body["param"] == field


def test_each_request_gets_one_access_log_line_with_its_tokens(client, server):
    httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS['alice']}"})
    r = client.chat.completions.create(model=MODEL, messages=msgs("Say hi."), temperature=0,
                                       max_tokens=3)
    expected = (f"prompt={r.usage.prompt_tokens} cached="
                f"{r.usage.prompt_tokens_details.cached_tokens} completion=3")

    def lines() -> list[str]:
        return [ln for ln in server.log().splitlines()
                if "POST /v1/chat/completions 200 " in ln and ln.endswith(expected)]

    deadline = time.monotonic() + 10  # the line is written once the response has gone out
    while not lines() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "GET /v1/models 200 " in server.log()
    assert lines()
