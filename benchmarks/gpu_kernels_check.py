"""Check the Triton kernels on a CUDA GPU against the float64 torch reference.

Large shapes, fresh random inputs for every case, outputs poisoned with NaN before each call,
every configuration the kernels support (dtypes, head dims, block sizes, GQA ratios), the direct
and split-K decode paths, mixed decode + prefill + extend batches, reshape_and_cache with
padding slots, a CUDA-graph capture of the decode path, and the ``chatgate_kernels`` dispatcher;
FP8 caches (decode, mixed batches, and the cache writes of ``reshape_and_cache`` and
``rotary_and_cache``, which must store the very codes torch's conversion gives).
The fused elementwise kernels (``chatgate_kernels/triton_fused.py``) are checked against
transformers' op-by-op torch code on the same GPU: the fraction of output elements that are not
bit-identical (rotary and the residual add must be exact; the norm's mean and SiLU's exp may move
a rare bf16 value by a step) and the relative error. The sampler's counter-based noise
(``chatgate_kernels/triton_sampling.py``) is checked against its torch reference, and the sampler's
draw replayed as CUDA graphs (``engine/draw_graphs.py``) against the eager sampler.
Prints a pass/fail table; exits 1 if any case fails.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_kernels_check.py
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chatgate_kernels  # noqa: E402
from chatgate_kernels import (  # noqa: E402
    reference,
    triton_attention,
    triton_cache,
    triton_fused,
    triton_sampling,
)
from engine.quantization import Fp8Linear  # noqa: E402

BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# (dtype, head_dim, block_size, num_kv_heads, group): every value of each axis appears.
CONFIGS = [
    (torch.bfloat16, 128, 16, 8, 4),
    (torch.bfloat16, 64, 8, 4, 8),
    (torch.bfloat16, 128, 32, 2, 3),
    (torch.bfloat16, 64, 32, 8, 1),
    (torch.float16, 128, 16, 4, 8),
    (torch.float16, 64, 8, 8, 3),
    (torch.float32, 128, 16, 8, 4),
    (torch.float32, 64, 32, 4, 1),
    (torch.float32, 128, 8, 2, 8),
]


class Paged:
    """A random varlen batch over a shuffled paged cache, on the GPU."""

    def __init__(self, seqs: list[tuple[int, int]], dtype: torch.dtype, head_dim: int,
                 block_size: int, num_kv_heads: int, group: int) -> None:
        dev = "cuda"
        need = [-(-s // block_size) for _, s in seqs]
        width = max(need) + 1
        num_blocks = sum(need) + 17
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.randn(shape, device=dev, dtype=dtype)
        self.value_cache = torch.randn(shape, device=dev, dtype=dtype)
        perm = torch.randperm(num_blocks, device=dev).to(torch.int32)
        wide = torch.randint(0, num_blocks, (len(seqs), width + 5), device=dev,
                             dtype=torch.int32)
        taken = 0
        for i, n in enumerate(need):
            wide[i, :n] = perm[taken:taken + n]
            taken += n
        self.block_tables = wide[:, :width]  # non-contiguous view, valid padding ids
        q_lens = [q for q, _ in seqs]
        self.query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, device=dev,
                                 dtype=dtype)
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        self.query_start_loc = torch.tensor(starts, device=dev, dtype=torch.int32)
        self.seq_lens = torch.tensor([s for _, s in seqs], device=dev, dtype=torch.int32)
        self.scale = head_dim**-0.5
        self.max_query_len = max(q_lens)
        self.max_seq_len = max(s for _, s in seqs)

    def tail(self) -> tuple:
        return (self.block_tables, self.seq_lens, self.query_start_loc, self.scale,
                self.max_query_len, self.max_seq_len)

    def reference(self) -> torch.Tensor:
        return reference.paged_attention(self.query.double(), self.key_cache.double(),
                                         self.value_cache.double(), *self.tail())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return ((out.double() - ref).norm() / ref.norm()).item()


def attention_case(batch: Paged, num_splits: int | None = None) -> float:
    out = torch.full_like(batch.query, float("nan"))
    triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                     *batch.tail(), out=out, num_splits=num_splits)
    torch.cuda.synchronize()
    return rel_err(out, batch.reference())


def cache_case(dtype: torch.dtype, head_dim: int, block_size: int, num_kv_heads: int) -> float:
    """Max abs difference to the reference scatter (0 expected), padding slots included."""
    num_blocks, num_tokens = 600, 4000
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=dtype)
    value_cache = torch.randn(shape, device="cuda", dtype=dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.float32)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:num_tokens]
    slots[torch.rand(num_tokens, device="cuda") < 0.2] = -1
    want_k, want_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    triton_cache.reshape_and_cache(key, value, key_cache, value_cache, slots.to(torch.int32))
    return max((key_cache.float() - want_k.float()).abs().max().item(),
               (value_cache.float() - want_v.float()).abs().max().item())


K_SCALE, V_SCALE = 0.013, 0.021  # FP8 cases: N(0, 1) values become codes up to ~350


def fp8_attention_case(seqs: list[tuple[int, int]], num_splits: int | None = None) -> float:
    """Attention over FP8 caches against the float64 reference over their dequantized values."""
    batch = Paged(seqs, torch.bfloat16, 128, 16, 8, 4)
    k8 = reference.to_cache(batch.key_cache, reference.FP8, K_SCALE)
    v8 = reference.to_cache(batch.value_cache, reference.FP8, V_SCALE)
    out = torch.full_like(batch.query, float("nan"))
    triton_attention.paged_attention(batch.query, k8, v8, *batch.tail(), out=out,
                                     num_splits=num_splits, k_scale=K_SCALE, v_scale=V_SCALE)
    torch.cuda.synchronize()
    want = reference.paged_attention(
        batch.query.double(), reference.from_cache(k8, torch.float64, K_SCALE),
        reference.from_cache(v8, torch.float64, V_SCALE), *batch.tail())
    return rel_err(out, want)


def fp8_write_case(fused: bool) -> float:
    """Fraction of FP8 codes that differ from torch's conversion (0 expected): the cache writes
    of ``reshape_and_cache`` or of ``rotary_and_cache`` (then on the rotated keys)."""
    num_blocks, block_size, num_kv_heads, head_dim, n = 600, 16, 8, 128, 4000
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.zeros(shape, device="cuda", dtype=reference.FP8) for _ in range(4)]
    key = torch.randn(n, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) * 4
    value = torch.randn_like(key) * 4
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:n]
    slots[torch.rand(n, device="cuda") < 0.2] = -1
    if fused:
        q = torch.randn(n, 32, head_dim, device="cuda", dtype=torch.bfloat16)
        angles = torch.rand(n, head_dim // 2, device="cuda") * 6
        cos = torch.cat([angles.cos()] * 2, -1).to(torch.bfloat16)
        sin = torch.cat([angles.sin()] * 2, -1).to(torch.bfloat16)
        reference.rotary_and_cache(q.clone(), key, value, cos, sin, caches[0], caches[1], slots,
                                   K_SCALE, V_SCALE)
        triton_fused.rotary_and_cache(q, key, value, cos, sin, caches[2], caches[3], slots,
                                      K_SCALE, V_SCALE)
    else:
        reference.reshape_and_cache(key, value, caches[0], caches[1], slots, K_SCALE, V_SCALE)
        triton_cache.reshape_and_cache(key, value, caches[2], caches[3], slots, K_SCALE,
                                       V_SCALE)
    torch.cuda.synchronize()
    differ = [(a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()
              for a, b in ((caches[2], caches[0]), (caches[3], caches[1]))]
    return max(differ)


def fp8_per_token_case() -> float:
    """Fraction of ``fp8_per_token``'s codes and scales that differ from the torch reference's
    (0 expected), over activations of the decoder's widths, bf16 ties included."""
    x = torch.randn(300, 14336, device="cuda", dtype=torch.bfloat16)
    x[::7] *= 1000
    x[5] = 0
    codes, scales = triton_fused.fp8_per_token(x)
    want_codes, want_scales = reference.fp8_per_token(x)
    differ = (codes.view(torch.uint8) != want_codes.view(torch.uint8)).float().mean().item()
    return max(differ, (scales != want_scales).float().mean().item())


def fp8_product_case() -> float:
    """Relative error of ``--quantization fp8``'s product (``Fp8Linear``) against the float64
    product of the operands it quantized: the tensor cores' accumulation and the bf16 output."""
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear(weight)
    codes, scales = reference.fp8_per_token(x)
    want = (codes.double() * scales.double()) @ layer.dequantized().double().t()
    return rel_err(layer(x), want)


def graph_case(num_seqs: int, replays: int, ordered: bool = False) -> float:
    """Capture decode once, replay with new queries and new (longer) lengths: worst error.
    Few sequences give split-K decode, whose merge counters must be back at zero after
    every replay. ``ordered``: the rows' longest-first order is sorted inside the graph, as
    the engine's decode graphs do, so each replay starts the programs in its own order."""
    batch = Paged([(1, 6000)] * num_seqs, torch.bfloat16, 128, 16, 8, 4)
    out = torch.full_like(batch.query, float("nan"))
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
            batch.seq_lens, batch.query_start_loc, batch.scale, 1, 6000)

    def decode() -> None:
        order = triton_attention.longest_first(batch.seq_lens) if ordered else None
        triton_attention.paged_attention(*args, out=out, row_order=order)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()
    worst = 0.0
    for _ in range(replays):
        batch.query.copy_(torch.randn_like(batch.query))
        batch.seq_lens.copy_(torch.randint(1, 6000, (num_seqs,), dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        worst = max(worst, rel_err(out, batch.reference()))
    return worst


def row_order_case(num_seqs: int) -> float:
    """Decode rows of mixed lengths started longest first against the same launch in order:
    the fraction of output elements that differ (0 expected: the order only schedules)."""
    lens = torch.randint(1, 3000, (num_seqs,)).tolist()
    batch = Paged([(1, n) for n in lens], torch.bfloat16, 128, 16, 8, 4)
    outs = []
    for order in (None, triton_attention.longest_first(batch.seq_lens)):
        out = torch.full_like(batch.query, float("nan"))
        triton_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache,
                                         *batch.tail(), out=out, row_order=order)
        outs.append(out)
    torch.cuda.synchronize()
    return mismatch(outs[1], outs[0])


def dispatch_case() -> float:
    batch = Paged([(1, 300), (40, 90)], torch.bfloat16, 64, 16, 2, 4)
    kernels = chatgate_kernels.model_kernels(batch.query.device, batch.key_cache.dtype)
    out = kernels.paged_attention(batch.query, batch.key_cache, batch.value_cache, *batch.tail())
    return rel_err(out, batch.reference())


def mismatch(got: torch.Tensor, want: torch.Tensor) -> float:
    """Fraction of elements that are not bit-identical (NaN counts as a mismatch)."""
    return (got != want).float().mean().item()


def noise_case() -> float:
    """The sampler's Exp(1) noise at a 256-row decode batch over Llama-3's vocabulary: the
    Triton kernel against the torch reference on the CPU (same integer hash; only the float32
    logarithm may round differently), as the largest relative error."""
    keys = torch.randint(0, 1 << 32, (256,))
    got = triton_sampling.exponential_noise(keys.cuda(), 128256).cpu()
    want = reference.exponential_noise(keys, 128256)
    return ((got - want).abs() / want).max().item()


def draw_graph_case(masks_kind: str) -> float:
    """The sampler's draw replayed as CUDA graphs (``engine.draw_graphs``) against the eager
    sampler on the same logits: greedy and temperature rows, seeded, SmolLM2's vocabulary, two
    batch sizes, each replayed over two fresh sets of logits (and masks: random bitmasks, one
    row without a grammar), and an all-greedy batch (its own graph). The masks lie in pinned
    host memory that the graph reads in place, one bitmask per batch (so the masked graphs are
    captured anew for each). ``masks_kind``: "none", "ready" (filled before the draw), or
    "late": the draw is queued while the bitmask is still all clear, and a thread fills it
    20 ms later and then sets the grammar's host signal, so the device must wait for it
    (``engine.stream_wait``; the masked graphs hold that wait). Returns the fraction of tokens
    that differ."""
    import threading
    from concurrent.futures import Future

    from engine.draw_graphs import DrawGraphs
    from engine.grammar_process import ended_bits
    from engine.sampler import draw, draw_key, shaped
    from engine.sampling_params import SamplingParams
    from engine.stream_wait import HostSignal, device_view
    from engine.structured import GrammarCompiler, GrammarMasks

    vocab, sizes = 49152, (8, 64)
    static = {size: torch.empty(size, vocab, dtype=torch.bfloat16, device="cuda")
              for size in sizes}
    graphs = DrawGraphs(static)
    signal = HostSignal.create(torch.zeros(1, dtype=torch.int32, pin_memory=True),
                               ended_bits(0))
    assert signal is not None, "no stream waits on host memory"
    number = 0
    wrong = total = 0
    for size, n, temperatures in ((8, 5, (0.0, 0.7, 1.5)), (64, 64, (0.0, 0.7, 1.5)),
                                  (8, 8, (0.0,)), (64, 50, (1.0, 0.0))):
        shared = torch.zeros(size, vocab // 32, dtype=torch.int32).pin_memory()
        for _ in range(2):
            static[size].normal_(0, 4)
            params = [SamplingParams(temperature=temperatures[i % len(temperatures)])
                      for i in range(n)]
            keys: list[int | None] = [draw_key(11, i) for i in range(n)]
            masks = reference = None
            if masks_kind != "none":
                filled = torch.randint(-(1 << 31), 1 << 31, (n, vocab // 32),
                                       dtype=torch.int32)
                filled[0] = -1  # a row without a grammar
                shared.zero_()  # all clear (the last draw has read it: its tokens were read)
                number += 1
                job: Future[None] = Future()

                def fill(bitmask=shared[:n], filled=filled, number=number, job=job) -> None:
                    bitmask.copy_(filled)
                    signal.set(ended_bits(number))
                    job.set_result(None)

                mapped = device_view(shared)
                assert mapped is not None, "pinned memory without a device address"
                masks = GrammarMasks(number, shared[:n], list(range(1, n)),
                                     lambda _, job=job: job.result(), signal, mapped)
                # the eager draw's masks: filled already, copied to the device
                reference = GrammarMasks(0, filled, masks.rows, lambda _: None, None)
                if masks_kind == "ready":
                    fill()
                else:
                    threading.Timer(0.02, fill).start()
            got = graphs.draw(size, params, keys, masks).clone()
            constrain = ((lambda x, m=reference: GrammarCompiler.apply(m, x))
                         if reference is not None else None)
            want = draw(shaped(static[size][:n], params, None, (), constrain), params, keys)
            wrong += int((got != want).sum())
            total += n
    return wrong / total


def fused_cases(dtype: torch.dtype) -> dict[str, Callable[[], float]]:
    """Llama-3.1-8B shapes, 4096 tokens. Each case returns the mismatch fraction, except the
    norm and SiLU in fp32, which return the relative error (a last-bit difference of a row's
    norm moves every element of the row)."""
    n, hidden, inter, heads, kv_heads, hd = 4096, 4096, 14336, 32, 8, 128
    dev = "cuda"

    def inexact(got: torch.Tensor, want: torch.Tensor) -> float:
        return rel_err(got, want.double()) if dtype == torch.float32 else mismatch(got, want)

    def norm_inputs() -> tuple[torch.Tensor, ...]:
        x = (torch.randn(n, hidden, device=dev) * 4).to(dtype)
        residual = (torch.randn(n, hidden, device=dev) * 4).to(dtype)
        weight = (1 + torch.randn(hidden, device=dev) / 4).to(dtype)
        return x, residual, weight

    def rms_norm() -> float:
        x, _, w = norm_inputs()
        return inexact(triton_fused.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))

    def add_rms_norm(part: str) -> float:
        x, residual, w = norm_inputs()
        want_residual = residual.clone()
        want = reference.add_rms_norm(x, want_residual, w, 1e-5)
        got = triton_fused.add_rms_norm(x, residual, w, 1e-5)
        return mismatch(residual, want_residual) if part == "residual" else inexact(got, want)

    def silu_and_mul() -> float:
        gate_up = (torch.randn(n, 2 * inter, device=dev) * 4).to(dtype)
        return inexact(triton_fused.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))

    def rotary(part: str) -> float:
        qkv = torch.randn(n, (heads + 2 * kv_heads) * hd, device=dev).to(dtype)
        q, k, v = (t.view(n, -1, hd) for t in qkv.split(
            [heads * hd, kv_heads * hd, kv_heads * hd], dim=-1))
        inv_freq = 1.0 / (500000 ** (torch.arange(0, hd, 2, device=dev).float() / hd))
        freqs = torch.outer(torch.arange(8192, device=dev).float(), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        positions = torch.randint(0, 8192, (n,), device=dev)
        cos, sin = cos[positions], sin[positions]  # each token's rows
        num_blocks, block_size = 400, 16
        slots = torch.randperm(num_blocks * block_size, device=dev)[:n]
        slots[torch.rand(n, device=dev) < 0.2] = -1
        shape = (num_blocks, block_size, kv_heads, hd)
        caches = [torch.full(shape, float("nan"), device=dev, dtype=dtype) for _ in range(4)]
        want_q = q.clone()
        reference.rotary_and_cache(want_q, k, v, cos, sin, caches[0], caches[1], slots)
        triton_fused.rotary_and_cache(q, k, v, cos, sin, caches[2], caches[3], slots)
        if part == "query":
            return mismatch(q, want_q)
        return max(mismatch(caches[2].nan_to_num(), caches[0].nan_to_num()),
                   mismatch(caches[3].nan_to_num(), caches[1].nan_to_num()))

    return {
        "rms_norm": rms_norm,
        "add_rms_norm out": lambda: add_rms_norm("out"),
        "add_rms_norm residual": lambda: add_rms_norm("residual"),
        "silu_and_mul": silu_and_mul,
        "rotary query": lambda: rotary("query"),
        "rotary+cache k/v": lambda: rotary("cache"),
    }


# bounds of the fused kernels: exact where only products and sums round; otherwise a bf16
# mismatch fraction, or an fp32 relative error
FUSED_BOUND = {"rms_norm": 0.01, "add_rms_norm out": 0.01, "add_rms_norm residual": 0.0,
               "silu_and_mul": 0.01, "rotary query": 0.0, "rotary+cache k/v": 0.0}
FUSED_FP32_BOUND = 1e-6


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.manual_seed(0)
    rows: list[tuple[str, str, float, float]] = []
    started = time.perf_counter()

    def record(config: str, case: str, fn: Callable[[], float], bound: float) -> None:
        t = time.perf_counter()
        try:
            err = fn()
        except Exception as exc:  # report and keep checking the other cases
            print(f"  {config} {case}: {type(exc).__name__}: {exc}")
            err = float("nan")
        rows.append((config, case, err, bound))
        verdict = "PASS" if err <= bound else "FAIL"
        print(f"[{time.perf_counter() - started:6.1f}s] {config:28s} {case:22s} "
              f"err={err:.2e} bound={bound:.0e} {verdict} ({time.perf_counter() - t:.1f}s)")

    for dtype, head_dim, block_size, num_kv_heads, group in CONFIGS:
        config = f"{NAMES[dtype]} d{head_dim} bs{block_size} kv{num_kv_heads} g{group}"
        geo = (dtype, head_dim, block_size, num_kv_heads, group)
        bound = BOUND[dtype]

        def decode(splits: int | None, geo=geo) -> float:
            lens = torch.randint(1, 4000, (48,)).tolist()
            return attention_case(Paged([(1, n) for n in lens], *geo), splits)

        def mixed(geo=geo) -> float:
            seqs = [(1, int(n)) for n in torch.randint(1, 4000, (16,))]
            seqs += [(q, q) for q in torch.randint(2, 600, (4,)).tolist()]
            seqs += [(q, q + p) for q, p in zip(torch.randint(2, 400, (4,)).tolist(),
                                                torch.randint(1, 3000, (4,)).tolist(),
                                                strict=True)]
            order = torch.randperm(len(seqs)).tolist()
            return attention_case(Paged([seqs[i] for i in order], *geo))

        record(config, "decode split-K", lambda d=decode: d(None), bound)
        record(config, "decode 1 split", lambda d=decode: d(1), bound)
        record(config, "decode 13 splits", lambda d=decode: d(13), bound)
        record(config, "mixed+prefix", mixed, bound)
        record(config, "reshape_and_cache", lambda g=geo: cache_case(*g[:4]), 0.0)
    record("bf16 d128 bs16 kv8 g4", "cuda graph replay", lambda: graph_case(64, 3),
           BOUND[torch.bfloat16])
    record("bf16 d128 bs16 kv8 g4", "graph replay split-K", lambda: graph_case(4, 20),
           BOUND[torch.bfloat16])
    record("bf16 d128 bs16 kv8 g4", "graph replay, longest first",
           lambda: graph_case(64, 3, ordered=True), BOUND[torch.bfloat16])
    record("bf16 d128 bs16 kv8 g4", "graph split-K, longest first",
           lambda: graph_case(4, 20, ordered=True), BOUND[torch.bfloat16])
    record("bf16 d128 bs16 kv8 g4", "longest first = in order", lambda: row_order_case(256),
           0.0)
    record("bf16 d64 bs16 kv2 g4", "kernels dispatch", dispatch_case, BOUND[torch.bfloat16])
    record("fp32 256 x 128256", "sampling noise", noise_case, 4 * torch.finfo().eps)
    record("bf16 logits, 49152 tokens", "draw graph", lambda: draw_graph_case("none"), 0.0)
    record("bf16 logits, 49152 tokens", "draw graph, masked",
           lambda: draw_graph_case("ready"), 0.0)
    record("bf16 logits, 49152 tokens", "draw graph, masks filled late",
           lambda: draw_graph_case("late"), 0.0)
    fp8 = "fp8 cache, bf16 d128 bs16 kv8 g4"
    decode_lens = [(1, int(n)) for n in torch.randint(1, 4000, (48,))]
    record(fp8, "decode split-K", lambda: fp8_attention_case(decode_lens), BOUND[torch.bfloat16])
    record(fp8, "decode 1 split", lambda: fp8_attention_case(decode_lens, 1),
           BOUND[torch.bfloat16])
    record(fp8, "mixed+prefix", lambda: fp8_attention_case(
        [(1, 3000), (300, 300), (1, 17), (200, 2200), (1, 900)]), BOUND[torch.bfloat16])
    record(fp8, "reshape_and_cache codes", lambda: fp8_write_case(False), 0.0)
    # the reference rotates with separate roundings; fp32 FMA-free fused math matches it
    record(fp8, "rotary+cache codes", lambda: fp8_write_case(True), 0.0)
    record("fp8 products, bf16 in", "per-token codes", fp8_per_token_case, 0.0)
    record("fp8 products, bf16 in", "Fp8Linear 256x4096", fp8_product_case,
           BOUND[torch.bfloat16])
    for dtype in (torch.bfloat16, torch.float32):
        for case, fn in fused_cases(dtype).items():
            exact = FUSED_BOUND[case] == 0.0
            bound = FUSED_FP32_BOUND if dtype == torch.float32 and not exact else FUSED_BOUND[case]
            record(f"fused {NAMES[dtype]}", case, fn, bound)

    failed = [r for r in rows if not r[2] <= r[3]]
    print(f"\n{'config':28s} {'case':22s} {'rel err':>9s} {'bound':>7s}  result")
    for config, case, err, bound in rows:
        print(f"{config:28s} {case:22s} {err:9.2e} {bound:7.0e}  "
              f"{'PASS' if err <= bound else 'FAIL'}")
    print(f"\n{len(rows) - len(failed)}/{len(rows)} passed in {time.perf_counter() - started:.0f}s"
          f" on {torch.cuda.get_device_name()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
