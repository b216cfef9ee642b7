"""Batched next-token sampling: greedy, temperature, top-k/top-p/min-p, per-request seeds, logprobs.

Invariants of :func:`sample`:

- a greedy row (temperature 0) gets exactly ``logits[i].argmax()``;
- a sampling row draws one exponential per vocabulary entry, a pure function of its 32-bit
  key (:func:`draw_key` of a seeded sequence's seed and output position, else a key from
  torch's global RNG), and its token depends only on its own logits, parameters and that
  noise: a seeded request yields the same tokens whatever else shares the batch, on CPU and
  GPU alike, and after a preemption recomputes it;
- a token that temperature/top-k/top-p/min-p left with probability 0 is never drawn;
- penalties, ``logit_bias`` and ``min_tokens`` (:func:`shape_logits`) change the logits every
  row (greedy too) chooses from; a row without them is untouched;
- logprobs are those of the raw logits (no penalty, temperature or filtering), as vLLM reports;
- on an accelerator the host waits once, for the final ``.tolist()``; :func:`draw` alone never
  waits (its tokens stay on the device).
"""

from collections.abc import Callable, Collection, Sequence

import torch

from chatgate_kernels import exponential_noise, exponential_noise_at
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

_CPU_NUCLEUS_DEPTH = 1024  # on CPU, top-p first looks for its nucleus among this many tokens
# on CPU, the race draws noise only for the nonzero probabilities when they are fewer than
# 1 in this many entries (top-p/top-k/min-p leave a few candidates per row)
SPARSE_RACE_SHARE = 8
_MASK64 = (1 << 64) - 1


def draw_key(seed: int, position: int) -> int:
    """The 32-bit noise key of a seeded sequence's draw at output ``position`` (0 for its
    first token): splitmix64's finaliser over the pair, so nearby seeds and positions give
    unrelated keys."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0xFFFFFFFF


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    keys: Sequence[int | None],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    eos_token_ids: Collection[int] = (),
    constrain: Callable[[torch.Tensor], None] | None = None,
    *,
    choose_from: torch.Tensor | None = None,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Draw one token per row of ``logits`` ``[num_rows, vocab]`` (any float dtype and device).

    Row ``i`` follows ``params[i]`` and draws with noise key ``keys[i]`` (see :func:`draw_key`)
    or, if it is None, a key from torch's global RNG. Returns the token ids and, per row, a
    :class:`TokenLogprob` when ``params[i].logprobs`` is not None (``top``: that many best
    tokens, descending), else None. A row whose params shape its logits (penalties,
    ``logit_bias``, ``min_tokens``; see :func:`shape_logits`) needs ``histories[i]`` = its
    (prompt ids, output ids so far); ``eos_token_ids`` are held back until ``min_tokens``.
    ``constrain`` (grammar masks) edits, last and in place, a float32 copy of the logits rows
    choose from. ``choose_from``: those logits, when the caller shaped them (:func:`shaped`).
    """
    num_rows = logits.shape[0]
    if not len(params) == len(keys) == num_rows:
        raise ValueError(f"{num_rows} logits rows but {len(params)} params and {len(keys)} keys")
    if choose_from is None:
        choose_from = shaped(logits, params, histories, eos_token_ids, constrain)
    return _with_logprobs(logits, draw(choose_from, params, keys), params)


def shaped(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    eos_token_ids: Collection[int] = (),
    constrain: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """The logits rows choose from: ``logits`` itself, or a float32 copy with the rows'
    penalties, bias and ``min_tokens`` applied (:func:`shape_logits`) and then ``constrain``
    (see :func:`sample`)."""
    raw = logits
    if any(p.shapes_logits for p in params):
        assert histories is not None, "penalties need each row's token history"
        logits = shape_logits(logits, params, histories, eos_token_ids)
    if constrain is not None:
        if logits is raw:
            logits = _float_copy(raw)
        constrain(logits)
    return logits


def draw(logits: torch.Tensor, params: Sequence[SamplingParams],
         keys: Sequence[int | None]) -> torch.Tensor:
    """The token of each row of ``logits`` as a tensor on their device, without waiting for
    it: the argmax for greedy rows, else temperature, top-k/top-p/min-p and the exponential
    race with the row's noise key (see :func:`sample`, which shapes the logits first)."""
    num_rows = logits.shape[0]
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(rows) < num_rows:
        tokens = row_argmax(logits)
    else:
        tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
    if rows:
        index = _to(rows, torch.long, logits.device)
        chosen = [params[i] for i in rows]
        x = logits if len(rows) == num_rows else logits.index_select(0, index)
        temperature = _column([p.temperature for p in chosen], x.device)
        probs = torch.softmax(x.float() / temperature, dim=-1)
        threshold = _top_k_top_p_threshold(
            probs, [p.top_k for p in chosen], [p.top_p for p in chosen]
        )
        if any(p.min_p > 0.0 for p in chosen):
            min_p = _column([p.min_p for p in chosen], x.device) * probs.amax(dim=-1, keepdim=True)
            threshold = min_p if threshold is None else torch.maximum(threshold, min_p)
        if threshold is not None:
            probs.masked_fill_(probs < threshold, 0.0)
        tokens.index_copy_(0, index, _exponential_race(probs, [keys[i] for i in rows]))
    return tokens


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)``: the first index of each row's maximum. On the CPU through
    ``max(dim=-1)`` (the same indices, ties to the first), which torch vectorises: a third of
    argmax's time over a 32-row, 49,152-entry step."""
    return x.max(dim=-1).indices if x.device.type == "cpu" else x.argmax(dim=-1)


def plain(params: SamplingParams) -> bool:
    """Whether a row's draw needs nothing but its temperature and noise key: greedy, or
    temperature without top-k, top-p, min-p or logits shaping (:func:`draw_plain` draws it)."""
    return not params.shapes_logits and (params.greedy or (
        params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0))


def draw_plain(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
               constrain: Callable[[torch.Tensor], None] | None = None,
               greedy_only: bool = False) -> torch.Tensor:
    """:func:`draw` of rows that are all :func:`plain`, as fixed-shape tensor ops without a host
    value (so that a CUDA graph can hold them): ``temperature`` ``[rows]`` float32 (0: greedy)
    and ``keys`` ``[rows]`` int64 (filled, see :func:`filled_keys`) are on the logits' device;
    ``constrain`` masks a float32 copy of the logits in place (every row: a row without a
    grammar gets an all-allowed mask); ``greedy_only``: every row is greedy (only the argmax is
    computed). Each row's token is the one :func:`draw` gives it after the same ``constrain``."""
    x = _float_copy(logits) if constrain is not None or logits.dtype != torch.float32 else logits
    if constrain is not None:
        constrain(x)
    if greedy_only:
        return row_argmax(x)
    greedy = temperature == 0
    probs = torch.softmax(x / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    race = row_argmax(probs / exponential_noise(keys, x.shape[1]))
    return torch.where(greedy, row_argmax(x), race)


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, copied from pinned memory on an accelerator so
    the host does not wait for the work already queued there."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def shape_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]],
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """A float32 copy of ``logits`` with each row's penalties, bias and ``min_tokens`` applied,
    batched over the rows that have any (others are unchanged), as vLLM and OpenAI define them:
    ``repetition_penalty`` divides a positive (multiplies a negative) logit of every token
    seen in the prompt or the output; ``frequency_penalty`` subtracts the token's count in
    the output, ``presence_penalty`` subtracts once if it occurs there; ``logit_bias`` adds;
    below ``min_tokens`` outputs the row's stop token ids (and EOS unless ``ignore_eos``) get
    ``-inf``."""
    rows = [i for i, p in enumerate(params) if p.shapes_logits]
    device, vocab = logits.device, logits.shape[1]
    out = _float_copy(logits)
    index = torch.tensor(rows, device=device)
    sub = out.index_select(0, index)
    chosen = [params[i] for i in rows]
    outputs = [list(histories[i][1]) for i in rows]
    counts = _token_counts(outputs, vocab, device)
    frequency = _column([p.frequency_penalty for p in chosen], device)
    presence = _column([p.presence_penalty for p in chosen], device)
    sub -= frequency * counts + presence * (counts > 0)
    if any(p.repetition_penalty != 1.0 for p in chosen):
        seen = (counts + _token_counts([list(histories[i][0]) for i in rows], vocab, device)) > 0
        penalty = _column([p.repetition_penalty for p in chosen], device)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    at, ids, values = [], [], []
    for row, (p, output) in enumerate(zip(chosen, outputs, strict=True)):
        for token, bias in p.logit_bias.items():
            at.append(row)
            ids.append(token)
            values.append(bias)
        if len(output) < p.min_tokens:
            held = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            at += [row] * len(held)
            ids += sorted(held)
            values += [float("-inf")] * len(held)
    if at:
        sub.index_put_((torch.tensor(at, device=device), torch.tensor(ids, device=device)),
                       torch.tensor(values, device=device), accumulate=True)
    return out.index_copy_(0, index, sub)


def _float_copy(logits: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``logits`` (one copy, whatever their dtype)."""
    return logits.clone() if logits.dtype == torch.float32 else logits.float()


def _token_counts(token_lists: list[list[int]], vocab: int,
                  device: torch.device) -> torch.Tensor:
    """``[len(token_lists), vocab]`` float32: how often each token occurs in each list."""
    longest = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)  # column vocab: padding
    if longest:
        padded = torch.tensor([t + [vocab] * (longest - len(t)) for t in token_lists],
                              device=device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """``values`` as a float32 ``[len(values), 1]`` tensor, to broadcast along the vocab."""
    return _to(values, torch.float32, device)[:, None]


def _top_k_top_p_threshold(
    probs: torch.Tensor, top_k: list[int], top_p: list[float]
) -> torch.Tensor | None:
    """Per row (``[rows, 1]``), the probability below which a token is outside the row's
    ``top_k`` most likely or outside the smallest most-likely set of those whose renormalised
    mass reaches ``top_p``; 0 for a row with neither filter, None when no row has one.

    ``probs`` rows are softmax outputs (sum 1). The most likely token always stays above the
    threshold; tokens tied with the last one kept stay too (vLLM keeps ties the same way).
    """
    num_rows, vocab = probs.shape
    rows = [i for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)) if 0 < k < vocab or p < 1]
    if not rows:
        return None
    ks = [top_k[i] if 0 < top_k[i] < vocab else vocab for i in rows]
    index = _to(rows, torch.long, probs.device)
    sub = probs if len(rows) == num_rows else probs.index_select(0, index)
    k = _to(ks, torch.long, probs.device)[:, None]
    p = _column([top_p[i] for i in rows], probs.device)
    # A row with top-p but no top-k needs its nucleus, which may reach deep into the vocabulary:
    # a full sort is cheap on an accelerator but slow on CPU, where a top-1024 is tried first.
    unbounded = vocab in ks
    depth = max((kk for kk in ks if kk < vocab), default=1)
    if unbounded:
        depth = vocab if probs.device.type != "cpu" else max(depth, min(vocab, _CPU_NUCLEUS_DEPTH))
    while True:
        values = sub.topk(depth, dim=-1).values
        keep = torch.arange(depth, device=probs.device) < k
        kept = values * keep
        total = torch.where(k < vocab, kept.sum(-1, keepdim=True), 1.0)
        keep &= (kept.cumsum(-1) - kept < p * total) | (p >= 1)  # stays a prefix of each row
        if depth == vocab or not unbounded:
            break
        closed = (kept.sum(-1, keepdim=True) >= p * total) | (k < vocab)
        if bool(closed.all()):  # every nucleus ends inside the top `depth` tokens
            break
        depth = vocab
    threshold = values.gather(1, keep.sum(-1, keepdim=True) - 1)
    if len(rows) == num_rows:
        return threshold
    return torch.zeros(num_rows, 1, device=probs.device).index_copy_(0, index, threshold)


def filled_keys(keys: Sequence[int | None]) -> list[int]:
    """``keys`` with each None (an unseeded row) replaced by a key from torch's global RNG."""
    unseeded = [row for row, key in enumerate(keys) if key is None]
    filled = list(keys)
    if unseeded:
        for row, key in zip(unseeded, torch.randint(0, 1 << 32, (len(unseeded),)).tolist(),
                            strict=True):
            filled[row] = key
    return filled


def _exponential_race(probs: torch.Tensor, keys: list[int | None]) -> torch.Tensor:
    """``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per token: an exact draw from each row of
    the unnormalised, non-negative ``probs`` (the Gumbel-max trick in multiplicative form).

    Each row's noise is a pure function of its key (``chatgate_kernels.exponential_noise``: one
    launch for the whole batch), so a seeded row's draw never depends on the rest of the batch; and
    unlike an inverse CDF, whose cumulative sums turn a tiny difference in the logits (another
    batch size, another kernel) into another token, the race only flips on a near-exact tie.
    A token of probability 0 is never drawn."""
    keys_tensor = _to(filled_keys(keys), torch.int64, probs.device)
    if (probs.device.type == "cpu"
            and int(torch.count_nonzero(probs)) * SPARSE_RACE_SHARE < probs.numel()):
        # on the CPU the noise costs more than the rest of the step: draw it only for the
        # tokens that can win (nonzero probability), the same values as dense
        rows, columns = probs.nonzero().unbind(1)
        race = torch.zeros_like(probs)
        race[rows, columns] = probs[rows, columns] / exponential_noise_at(keys_tensor[rows],
                                                                          columns)
        return row_argmax(race)
    return row_argmax(probs / exponential_noise(keys_tensor, probs.shape[1]))


def _with_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Move the tokens (and the requested logprobs) to the host in one transfer."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    parts = [tokens.double()]
    top = max((params[i].logprobs or 0 for i in wanted), default=0)
    if wanted:
        index = torch.tensor(wanted, device=logits.device)
        logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
        parts.append(logp.gather(1, tokens.index_select(0, index)[:, None]).squeeze(1).double())
        if top:
            values, ids = logp.topk(top, dim=-1)
            parts += [values.double().flatten(), ids.double().flatten()]
    flat = torch.cat(parts).tolist()  # token ids < 2**53 survive float64 exactly
    num_rows, num_wanted = len(params), len(wanted)
    token_ids = [int(t) for t in flat[:num_rows]]
    out: list[TokenLogprob | None] = [None] * num_rows
    values_at, ids_at = num_rows + num_wanted, num_rows + num_wanted + num_wanted * top
    for j, i in enumerate(wanted):
        k = params[i].logprobs or 0
        row_values = flat[values_at + j * top : values_at + j * top + k]
        row_ids = flat[ids_at + j * top : ids_at + j * top + k]
        best = [(int(t), v) for t, v in zip(row_ids, row_values, strict=True)]
        out[i] = TokenLogprob(token_id=token_ids[i], logprob=flat[num_rows + j], top=best)
    return token_ids, out
