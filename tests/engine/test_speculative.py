"""Speculative decoding with n-gram drafts is lossless on the real SmolLM2 (float32, CPU):
greedy and seeded sampled outputs, with penalties, bias, min_tokens, stop strings, logprobs and
n > 1, are token for token those of plain decoding, drafts are accepted on copying prompts, and
a rejected draft's KV reaches neither the prefix cache nor a pinned session. The acceptance
rule keeps the target distribution (a toy distribution, chi-square)."""

import math
from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, SpeculativeConfig
from engine.sampler import draw, draw_key
from engine.sequence import Sequence
from engine.speculative import PROBE_INTERVAL, Speculator, accepted, propose_ngram

CODE = """def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, email = line.strip().split(",")
            users.append({"name": name, "email": email})
    return users


def find_user(users, name):
    for user in users:
        if user["name"] == name:
            return user
    return None
"""
EDITS = [
    f"Rename {old} to {new} in this code and output the whole code.\n\n```python\n{CODE}```"
    for old, new in [("users", "people"), ("load_users", "read_people"),
                     ("handle", "stream"), ("find_user", "lookup")]
]
OTHERS = ["Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums.",
          "What is the capital of France?", "Write a haiku about GPUs.",
          "Count from 1 to 20, separated by commas."]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def engines(smollm2) -> tuple[LLM, LLM]:
    """Plain and speculative engines on the same weights."""
    plain = LLM("smollm2", loaded=smollm2, num_kv_blocks=400)
    spec = LLM("smollm2", loaded=smollm2, num_kv_blocks=400, speculative_config=SPEC)
    return plain, spec


def _chats() -> list[list[dict]]:
    return [[{"role": "user", "content": text}] for text in EDITS + OTHERS]


def _outputs(llm: LLM, params: SamplingParams) -> list[list[tuple]]:
    outs = llm.chat(_chats(), params)
    return [[(c.token_ids, c.text, c.finish_reason,
              [(lp.token_id, round(lp.logprob, 3)) for lp in c.logprobs or []])
             for c in out.outputs] for out in outs]


def test_greedy_output_is_identical_and_drafts_are_accepted(engines: tuple[LLM, LLM]) -> None:
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=48)
    before = spec.engine.stats()
    assert _outputs(spec, params) == _outputs(plain, params)
    after = spec.engine.stats()
    assert after.spec_decode_num_drafts > before.spec_decode_num_drafts
    accepted_now = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    assert accepted_now > 0
    assert plain.engine.stats().spec_decode_num_drafts == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=40, logprobs=2),
    SamplingParams(temperature=0.7, seed=9, max_tokens=40, repetition_penalty=1.1,
                   frequency_penalty=0.3, presence_penalty=0.2, logit_bias={29889: 2.0},
                   min_tokens=12, stop=["\n\n", "None"]),
    SamplingParams(temperature=0, max_tokens=33, stop=["return"], n=2),
    SamplingParams(temperature=1.0, top_k=20, seed=3, n=3, max_tokens=30),
], ids=["seeded-top-p-logprobs", "penalties-bias-min-tokens-stops", "greedy-stop-n2",
        "seeded-n3"])
def test_sampled_output_is_identical(engines: tuple[LLM, LLM], params: SamplingParams) -> None:
    plain, spec = engines
    assert _outputs(spec, params) == _outputs(plain, params)


def test_overlapped_scheduling_keeps_the_output(smollm2, engines: tuple[LLM, LLM]) -> None:
    """With overlapped steps (the CUDA default) a drafting step reads the one in flight first:
    the same tokens, and drafts were verified."""
    plain, _ = engines
    overlapped = LLM("smollm2", loaded=smollm2, num_kv_blocks=400, async_scheduling=True,
                     speculative_config=SPEC)
    params = SamplingParams(temperature=0, max_tokens=40)
    chats = _chats()[:1] + _chats()[-3:]
    assert ([o.outputs[0].token_ids for o in overlapped.chat(chats, params)]
            == [o.outputs[0].token_ids for o in plain.chat(chats, params)])
    assert overlapped.engine.stats().spec_decode_num_accepted_tokens > 0


def test_overlapped_steps_that_find_no_drafts_lose_no_output(smollm2,
                                                              engines: tuple[LLM, LLM]) -> None:
    """A step that reads the one in flight to look for drafts, finds none and so overlaps
    returns the outputs of that read too: every request finishes, with plain decoding's
    tokens."""
    plain, _ = engines
    overlapped = LLM("smollm2", loaded=smollm2, num_kv_blocks=400, async_scheduling=True,
                     speculative_config=SPEC)
    speculator = overlapped.engine.speculator
    speculator.active = lambda running, in_flight: True  # looks at every step ...
    speculator.propose = lambda running: None  # ... and finds nothing
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 16, 24)]
    chats = _chats()[:3]  # finishing at different steps, while others run on
    assert ([o.outputs[0].token_ids for o in overlapped.chat(chats, params)]
            == [o.outputs[0].token_ids for o in plain.chat(chats, params)])


def test_sessions_pin_only_accepted_tokens(engines: tuple[LLM, LLM]) -> None:
    """Two turns of a pinned session: the same answers, the same pinned tokens, and every
    hashed block and the pin hold KV equal to the plain engine's for the same tokens."""
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=40)
    history = [{"role": "user", "content": EDITS[0]}]
    for turn in range(2):
        a = plain.chat(history, params, session_id="s")[0].outputs[0]
        b = spec.chat(history, params, session_id="s")[0].outputs[0]
        assert a.token_ids == b.token_ids, turn
        pin_a, pin_b = plain.engine.kv.pinned("s"), spec.engine.kv.pinned("s")
        assert pin_a.token_ids == pin_b.token_ids
        _assert_same_kv(plain, spec, pin_a.block_ids, pin_b.block_ids, len(pin_a.token_ids))
        history += [{"role": "assistant", "content": b.text},
                    {"role": "user", "content": "Now rename email to address too."}]
    pool = spec.engine.kv.pool
    for block_hash, block in pool.cached.items():
        other = plain.engine.kv.pool.cached.get(block_hash)
        if other is not None:
            _assert_same_kv(plain, spec, [other.block_id], [block.block_id], 16)
    plain.unpin_session("s")
    spec.unpin_session("s")


def _assert_same_kv(plain: LLM, spec: LLM, blocks_a: list[int], blocks_b: list[int],
                    num_tokens: int) -> None:
    bs = plain.engine.config.block_size
    ka = plain.engine.runner.kv_cache[:, :, blocks_a].flatten(2, 3)[:, :, :num_tokens]
    kb = spec.engine.runner.kv_cache[:, :, blocks_b].flatten(2, 3)[:, :, :num_tokens]
    assert ka.shape[2] == min(num_tokens, len(blocks_a) * bs)
    torch.testing.assert_close(ka, kb, rtol=1e-4, atol=1e-4)


def test_acceptance_rule_keeps_the_target_distribution() -> None:
    """Two positions with toy distributions p and q and the draft (d1, d2): the tokens a verify
    appends are distributed as plain decoding's (p, then q after d1), chi-square at 1e-3."""
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q = torch.tensor([0.1, 0.6, 0.3, 0.0])
    drafts = [1, 2]
    logits = torch.stack([p.log(), q.log(), q.log()])  # rows after nothing, d1, d1 d2
    params = [SamplingParams(temperature=1.0, seed=0)] * 3
    counts: Counter[tuple[int, ...]] = Counter()
    trials = 20000
    for trial in range(trials):
        keys = [draw_key(trial, position) for position in range(3)]
        sampled = draw(logits, params, keys).tolist()
        counts[tuple(accepted(drafts, sampled)[:2])] += 1
    expected = {(x,): trials * float(p[x]) for x in range(4) if x != drafts[0]}
    expected.update({(drafts[0], y): trials * float(p[drafts[0]] * q[y])
                     for y in range(4) if q[y] > 0})
    assert set(counts) <= set(expected)
    chi2 = sum((counts[k] - e) ** 2 / e for k, e in expected.items())
    dof = len(expected) - 1
    # 1e-3 critical value of chi-square with 5 degrees of freedom
    assert dof == 5 and chi2 < 20.52, (chi2, counts)
    rejected = sum(n for k, n in counts.items() if k[0] != drafts[0]) / trials
    assert math.isclose(rejected, 1 - float(p[drafts[0]]), abs_tol=0.015)


def test_ngram_proposer_takes_the_longest_latest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert propose_ngram(tokens, 3, 1, 3) == [4, 5, 7]  # "2 3" last seen before "4 5 7"
    assert propose_ngram(tokens, 3, 3, 3) == []  # "7 2 3" occurs nowhere earlier
    assert propose_ngram([5, 6, 5], 4, 1, 2) == [6, 5]  # drafts stop at the end


@pytest.mark.parametrize("options, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method must be 'ngram'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "exceeds prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown field"),
])
def test_bad_speculative_config_is_a_clear_error(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=options)


def test_lookup_bounds_default_to_each_other() -> None:
    one = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 6})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (6, 6)
    assert EngineConfig().speculative_config is None  # off by default


def _decoding(tokens: list[int]) -> Sequence:
    seq = Sequence("r", 0, tokens[:4], SamplingParams(max_tokens=1000), None)
    seq.token_ids = list(tokens)
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def test_drafts_back_off_when_rejected_and_under_load() -> None:
    """A sequence whose drafts are rejected drafts again only every PROBE_INTERVAL-th step,
    for as long as it runs (the engine asks ``active`` each step and proposes only when it says
    so); no sequence drafts while more than disable_by_batch_size run."""
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 1, "disable_by_batch_size": 2})
    speculator = Speculator(config, max_model_len=4096)
    seq = _decoding([1, 2, 3, 1, 2, 3, 1, 2])
    drafted_steps = []
    for step in range(40):
        if speculator.active([seq], in_flight=False):
            speculator.propose([seq])
        if seq.draft_token_ids:
            drafted_steps.append(step)
            speculator.verdict(seq, [9] * (len(seq.draft_token_ids) + 1))  # all rejected
    assert drafted_steps[:4] == [0, 1, 2, 3]  # until the average falls under MIN_ACCEPTANCE
    gaps = [b - a for a, b in zip(drafted_steps[3:], drafted_steps[4:], strict=False)]
    assert gaps and set(gaps) == {PROBE_INTERVAL}  # probes, of one draft each
    assert speculator.counters.num_draft_tokens == 4 * 3 + len(gaps)
    sizes = []  # the text turns copyable again: an accepted probe brings back K drafts
    for _ in range(2 * PROBE_INTERVAL):
        if speculator.active([seq], in_flight=False):
            speculator.propose([seq])
        if seq.draft_token_ids:
            sizes.append(len(seq.draft_token_ids))
            speculator.verdict(seq, [*seq.draft_token_ids, 9])  # all accepted
    assert sizes[0] == 1 and set(sizes[1:]) == {3}
    crowd = [_decoding([1, 2, 3, 1, 2, 3, 1, 2]) for _ in range(3)]
    assert not speculator.active(crowd, in_flight=False)
