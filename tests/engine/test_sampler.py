"""engine.sampler: greedy, seeded reproducibility, top-k/top-p/min-p, distribution, logprobs,
and the fixed-shape draw that CUDA graphs hold."""

import pytest
import torch

from engine.sampler import (
    _exponential_race,
    _top_k_top_p_threshold,
    draw,
    draw_key,
    draw_plain,
    plain,
    sample,
    shape_logits,
    shaped,
)
from engine.sampling_params import SamplingParams


def _logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_argmax(dtype: torch.dtype) -> None:
    logits = _logits(8, 49152).to(dtype)
    params = [SamplingParams(temperature=0.0, logprobs=None if i % 2 else 2) for i in range(8)]
    tokens, logprobs = sample(logits, params, [None] * 8)
    assert tokens == logits.argmax(-1).tolist()
    assert [lp is None for lp in logprobs] == [bool(i % 2) for i in range(8)]


def test_greedy_rows_exact_in_a_mixed_batch() -> None:
    logits = _logits(6, 1000)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=i) for i in range(6)]
    tokens, _ = sample(logits, params, [None] * 6)
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()


def test_seeded_rows_reproducible_and_independent_of_the_batch() -> None:
    vocab, steps = 4096, 12
    logits = [_logits(1, vocab, seed=s, scale=1.0) for s in range(steps)]
    target = SamplingParams(temperature=1.0, seed=7)

    def run(others: list[SamplingParams], position: int, other_seeds: bool) -> list[int]:
        params = list(others)
        params.insert(position, target)
        out = []
        for step in range(steps):
            keys: list[int | None] = [
                draw_key(100 + i, step) if other_seeds else None for i in range(len(others))
            ]
            keys.insert(position, draw_key(7, step))
            rows = [_logits(1, vocab, seed=1000 + step * 10 + i)[0] for i in range(len(params))]
            rows[position] = logits[step][0]
            tokens, _ = sample(torch.stack(rows), params, keys)
            out.append(tokens[position])
        return out

    alone = run([], 0, False)
    assert alone == run([], 0, False)
    assert len(set(alone)) > 1  # really sampling
    mixed = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.3, top_p=0.5, min_p=0.01),
    ]
    assert run(mixed, 1, other_seeds=False) == alone
    assert run(mixed, 3, other_seeds=True) == alone


def test_draw_keys_differ_across_seeds_and_positions() -> None:
    keys = {draw_key(seed, position) for seed in range(-50, 50) for position in range(100)}
    assert len(keys) == 100 * 100
    assert all(0 <= k < 1 << 32 for k in keys)


def test_unseeded_rows_follow_the_global_rng() -> None:
    logits = _logits(8, 1000, scale=1.0)
    params = [SamplingParams(temperature=1.0)] * 8
    torch.manual_seed(5)
    first, _ = sample(logits, params, [None] * 8)
    torch.manual_seed(5)
    assert sample(logits, params, [None] * 8)[0] == first
    assert sample(logits, params, [None] * 8)[0] != first


def test_top_k_one_and_tiny_top_p_equal_greedy() -> None:
    logits = _logits(16, 49152, scale=1.0)
    greedy = logits.argmax(-1).tolist()
    for params in (
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=1.0, top_k=50, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ):
        tokens, _ = sample(logits, [params] * 16, [None] * 16)
        assert tokens == greedy, params


def _reference_keep(probs: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens a row keeps, by a plain full sort."""
    order = probs.argsort(descending=True).tolist()
    if top_k:
        order = order[:top_k]
    mass = float(probs[order].sum())
    kept, before = [], 0.0
    for t in order:
        if before >= top_p * mass and top_p < 1:
            break
        kept.append(t)
        before += float(probs[t])
    return set(kept)


@pytest.mark.parametrize("vocab", [300, 5000])
def test_top_k_top_p_mask_matches_a_full_sort(vocab: int) -> None:
    # Flat rows make a nucleus deeper than the CPU's first top-1024 attempt.
    gen = torch.Generator().manual_seed(3)
    scales = [0.05, 0.5, 2.0, 6.0, 0.05, 2.0]
    ks = [0, 0, 5, 0, 2000, 40]
    ps = [0.9, 0.6, 0.8, 0.95, 0.99, 1.0]
    probs = torch.softmax(torch.randn(6, vocab, generator=gen) * torch.tensor(scales)[:, None], -1)
    threshold = _top_k_top_p_threshold(probs, ks, ps)
    assert threshold is not None
    for row, (k, p) in enumerate(zip(ks, ps, strict=True)):
        kept = set((probs[row] >= threshold[row]).nonzero().flatten().tolist())
        expected = _reference_keep(probs[row], k if k < vocab else 0, p)
        assert len(kept ^ expected) <= 1, (row, len(kept), len(expected))  # float ties at the cut
    assert _top_k_top_p_threshold(probs, [0] * 6, [1.0] * 6) is None
    partial = _top_k_top_p_threshold(probs, [0, 3, 0, 0, 0, 0], [1.0] * 6)
    assert partial is not None and partial[0].item() == 0.0
    assert partial[1].item() == probs[1].topk(3).values[-1].item()


def test_filtered_tokens_are_never_sampled() -> None:
    logits = _logits(1, 2000, seed=5, scale=2.0).expand(1000, -1)
    probs = torch.softmax(logits[0], -1)
    cases = [
        (SamplingParams(top_k=7), set(probs.topk(7).indices.tolist())),
        (SamplingParams(top_p=0.5), _reference_keep(probs, 0, 0.5)),
        (SamplingParams(min_p=0.2), set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())),
    ]
    torch.manual_seed(0)
    for params, allowed in cases:
        tokens, _ = sample(logits, [params] * 1000, [None] * 1000)
        assert set(tokens) <= allowed, params
        assert len(set(tokens)) > 1


def test_race_never_draws_a_zero_probability_token() -> None:
    gen = torch.Generator().manual_seed(1)
    probs = torch.rand(64, 1000, generator=gen) * (torch.rand(64, 1000, generator=gen) < 0.02)
    probs[:, 0] += (probs.sum(-1) == 0).float()  # every row needs some mass
    for _ in range(20):
        tokens = _exponential_race(probs, [None] * 64)
        assert bool((probs.gather(1, tokens[:, None]) > 0).all())


def test_sparse_race_draws_the_dense_races_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the race draws noise only for nonzero probabilities when they are few; with
    the same keys it picks exactly the token the full-vocabulary race picks."""
    import engine.sampler

    gen = torch.Generator().manual_seed(2)
    probs = torch.rand(32, 5000, generator=gen) * (torch.rand(32, 5000, generator=gen) < 0.01)
    probs[:, 7] += 1e-3  # every row needs some mass
    keys = [draw_key(11, i) for i in range(32)]
    sparse = _exponential_race(probs, keys)
    monkeypatch.setattr(engine.sampler, "SPARSE_RACE_SHARE", 0)  # always dense
    assert torch.equal(sparse, _exponential_race(probs, keys))


def test_race_is_robust_to_tiny_perturbations() -> None:
    """The same seed on logits that differ in the last bits (another batch size) gives the same
    token (an inverse CDF flips whenever its uniform lands near a shifted boundary)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(200, 49152, generator=gen) * 3
    noisy = logits * (1 + 1e-6 * torch.randn(200, 49152, generator=gen))
    params = [SamplingParams(temperature=0.8, seed=5)] * 200
    keys = [draw_key(5, i) for i in range(200)]
    a, _ = sample(logits, params, keys)
    b, _ = sample(noisy, params, keys)
    assert a == b


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.5, 0, 1.0, 0.0),
        (2.0, 0, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (1.0, 0, 0.7, 0.0),
        (1.0, 0, 1.0, 0.3),
    ],
)
def test_frequencies_follow_the_filtered_softmax(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    draws = 20000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    torch.manual_seed(1234)
    tokens, _ = sample(logits.expand(draws, -1), [params] * draws, [None] * draws)
    expected = torch.softmax(logits[0] / temperature, -1)
    keep = _reference_keep(expected, top_k, top_p)
    keep &= set((expected >= min_p * expected.max()).nonzero().flatten().tolist())
    mask = torch.zeros(6, dtype=torch.bool)
    mask[list(keep)] = True
    expected = expected * mask / (expected * mask).sum()
    observed = torch.bincount(torch.tensor(tokens), minlength=6).float() / draws
    assert torch.allclose(observed, expected, atol=0.015), (observed, expected)


def test_temperature_sharpens_and_flattens() -> None:
    logits = _logits(1, 1000, seed=2, scale=1.0).expand(2000, -1)
    distinct = {}
    for t in (0.05, 1.0, 2.0):
        torch.manual_seed(0)
        tokens, _ = sample(logits, [SamplingParams(temperature=t)] * 2000, [None] * 2000)
        distinct[t] = len(set(tokens))
    assert distinct[0.05] < distinct[1.0] < distinct[2.0]


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = _logits(4, 49152, seed=9).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.8, top_k=10, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.9, logprobs=20),
    ]
    tokens, logprobs = sample(logits, params, [draw_key(i, 0) for i in range(4)])
    raw = torch.log_softmax(logits.float(), -1)
    assert logprobs[2] is None
    for row in (0, 1, 3):
        lp = logprobs[row]
        assert lp is not None and lp.token_id == tokens[row]
        assert lp.logprob == pytest.approx(raw[row, tokens[row]].item(), abs=1e-5)
        k = params[row].logprobs
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        best = raw[row].topk(k) if k else None
        if best is not None:
            assert [t for t, _ in lp.top] == best.indices.tolist()
            assert values == pytest.approx(best.values.tolist(), abs=1e-5)
    assert logprobs[1].top == []


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="params"):
        sample(_logits(2, 10), [SamplingParams()], [None, None])


def test_frequency_and_presence_penalties_lower_repeated_tokens() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 3] = 1.0  # the greedy choice, until it has been repeated enough
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.4, presence_penalty=0.1)]
    assert sample(logits, params, [None], [((), [])])[0] == [3]
    assert sample(logits, params, [None], [((), [3])])[0] == [3]  # 1 - 0.4 - 0.1 > 0
    assert sample(logits, params, [None], [((), [3, 3, 3])])[0] != [3]  # 1 - 1.2 - 0.1 < 0
    shaped = shape_logits(logits, params, [((5, 5), [3, 3, 7])], ())
    assert shaped[0, 3].item() == pytest.approx(1.0 - 0.8 - 0.1)
    assert shaped[0, 7].item() == pytest.approx(-0.5)
    assert shaped[0, 5].item() == 0.0  # prompt tokens are not penalised by these two


def test_repetition_penalty_scales_every_seen_token_toward_less_likely() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    shaped = shape_logits(logits, params, [((0,), [1])], ())
    assert shaped.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_logit_bias_and_min_tokens_and_untouched_rows() -> None:
    logits = _logits(3, 100, seed=4, scale=1.0)
    eos = 7
    params = [SamplingParams(temperature=0.0, logit_bias={42: 100.0}),
              SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9]),
              SamplingParams(temperature=0.0)]
    logits[1, eos] = 50.0
    histories = [((1,), []), ((1,), [4]), ((), ())]
    tokens, _ = sample(logits, params, [None] * 3, histories, {eos})
    assert tokens[0] == 42
    assert tokens[1] not in (eos, 9)  # one output so far: EOS and stop ids held back
    assert tokens[2] == logits[2].argmax().item()
    tokens, _ = sample(logits, params, [None] * 3, [((1,), []), ((1,), [4, 5]), ((), ())],
                       {eos})
    assert tokens[1] == eos  # min_tokens reached


def test_logprobs_stay_raw_under_penalties() -> None:
    logits = _logits(1, 50, seed=6)
    params = [SamplingParams(temperature=0.0, logprobs=1, frequency_penalty=2.0)]
    top = logits[0].argmax().item()
    tokens, logprobs = sample(logits, params, [None], [((), [top] * 5)])
    assert tokens[0] != top
    raw = torch.log_softmax(logits[0], -1)
    assert logprobs[0] is not None
    assert logprobs[0].logprob == pytest.approx(raw[tokens[0]].item(), abs=1e-5)


@pytest.mark.parametrize("kwargs", [{"presence_penalty": 2.5}, {"frequency_penalty": -3},
                                    {"repetition_penalty": 0.0}, {"logit_bias": {1: 101}},
                                    {"min_tokens": -1}, {"min_tokens": 5, "max_tokens": 4}])
def test_out_of_range_shaping_params_are_rejected(kwargs) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True], ids=["free", "grammar-masked"])
def test_draw_plain_gives_each_row_the_token_of_draw(dtype: torch.dtype, masked: bool) -> None:
    """Greedy and temperature rows, seeded, masked (a random half of each row's tokens, one row
    left alone) or not: the graph-capturable draw and the eager one pick the same tokens."""
    logits = _logits(12, 3000, seed=4).to(dtype)
    params = [SamplingParams(temperature=(0.0, 0.6, 1.0, 1.9)[i % 4]) for i in range(12)]
    keys = [draw_key(99, i) for i in range(12)]
    allowed = torch.rand(12, 3000, generator=torch.Generator().manual_seed(5)) < 0.5
    allowed[3] = True

    def mask(x: torch.Tensor) -> None:
        x.masked_fill_(~allowed, float("-inf"))

    constrain = mask if masked else None
    want = draw(shaped(logits, params, None, (), constrain), params, keys)
    got = draw_plain(logits, torch.tensor([p.temperature for p in params]),
                     torch.tensor(keys), constrain)
    assert torch.equal(got, want)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    assert got[sampled].tolist() != logits.float().argmax(-1)[sampled].tolist()  # a race ran
    if masked:
        assert bool(allowed[torch.arange(12), got].all())
    greedy = [SamplingParams(temperature=0.0)] * 12
    assert torch.equal(draw_plain(logits, torch.zeros(12), torch.tensor(keys), constrain,
                                  greedy_only=True),
                       draw(shaped(logits, greedy, None, (), constrain), greedy, keys))


def test_plain_rows_need_nothing_but_temperature_and_key() -> None:
    assert plain(SamplingParams(temperature=0.0))
    assert plain(SamplingParams(temperature=0.0, top_p=0.5))  # greedy: filters change nothing
    assert plain(SamplingParams(temperature=0.8))
    assert not plain(SamplingParams(temperature=0.8, top_p=0.9))
    assert not plain(SamplingParams(temperature=0.8, top_k=40))
    assert not plain(SamplingParams(temperature=0.8, min_p=0.1))
    assert not plain(SamplingParams(temperature=0.0, frequency_penalty=0.5))
