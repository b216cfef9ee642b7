"""Transformers as the reference: greedy tokens compared with the engine's (teacher-forced logit
margins at each divergence, the float32 computation of the same weights as the arbiter) and
its offline throughput with ``generate(cache_implementation="static")``, for ``gpu_e2e.py``.

Correctness: random-token prompts, greedy tokens each, the engine (batched, CUDA graphs) against
transformers' own greedy decoding (``generate``, ``do_sample=False``, one prompt at a time, EOS
disabled like ``ignore_eos``). Random weights can make near-tied logits; every divergence is
reported with its logit margin in transformers' logits (top-1 minus the logit of the engine's
token, teacher-forced on the engine's tokens). Transformers is also run on the same prompts as
one left-padded batch: how often it agrees with itself shows how much of a 16-bit divergence is
batch shape alone. In 16 bits both implementations are also compared with the exact computation
(the same weights in float32), and the check can be repeated with the embedding matrix scaled by
``EMBED_SCALE`` (exact in bf16, undone afterwards).

Throughput: the same requests in arrival order, left-padded batches of the largest batch size
that fits (probed in the same run, with the longest prompt and output),
``generate(cache_implementation="static")``, which compiles its decoding forward
(``torch.compile``, mode "reduce-overhead") by default for a static cache on a GPU. Each batch's
shapes are compiled (and their CUDA graphs recorded) in an untimed warm-up that stops after a
few tokens; that one-time cost is reported separately. Every batch is timed unless
``--hf-batches N`` limits it to the first N (their rate, useful output tokens per second, i.e.
the requested lengths, not padding, is then extrapolated to the whole set); ``--hf-eager`` turns
transformers' compile off (``disable_compile=True``).
"""

import argparse

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from benchmarks._common import log
from benchmarks.hardware import release_memory, sync, wall_s
from benchmarks.offline_throughput import prompt_vocab
from engine import LLM, SamplingParams
from engine.loader import LoadedModel, build_hf_model, load_model

EMBED_SCALE = 16.0


def left_padded(prompts: list[list[int]],
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of ``prompts`` left-padded to the longest (pad id 0)."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    return ids.to(device), mask.to(device)


def hf_greedy_batch(hf, prompts: list[list[int]], num_tokens: int,
                    device: torch.device) -> list[list[int]]:
    """Transformers' greedy tokens for ``prompts`` generated together as one left-padded batch."""
    ids, mask = left_padded(prompts, device)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=num_tokens, do_sample=False,
                      pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def teacher_forced_margins(hf, prompt: list[int], tokens: list[int],
                           device: torch.device) -> list[float]:
    """Per generated position: transformers' top-1 logit minus its logit of ``tokens[j]``
    (0 where the engine's token is transformers' argmax), fed the engine's own tokens."""
    ids = torch.tensor([prompt + tokens[:-1]], device=device)
    with torch.inference_mode():
        logits = hf(ids).logits[0, len(prompt) - 1:].float()
    chosen = logits.gather(1, torch.tensor(tokens, device=device)[:, None]).squeeze(1)
    return (logits.max(dim=1).values - chosen).tolist()


def top2_gap(hf, prompt: list[int], device: torch.device) -> float:
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def check_correctness(llm: LLM, hf, prompts: list[list[int]], num_tokens: int,
                      device: torch.device) -> dict:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    engine_tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    hf_batched = hf_greedy_batch(hf, prompts, num_tokens, device)
    rows = []
    for i, (prompt, mine) in enumerate(zip(prompts, engine_tokens, strict=True)):
        theirs = hf_greedy_batch(hf, [prompt], num_tokens, device)[0]  # one at a time
        margins = teacher_forced_margins(hf, prompt, mine, device)
        first = next((j for j, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b),
                     None)
        row = {"prompt": i, "prompt_len": len(prompt), "equal": first is None,
               "first_divergence": first, "max_teacher_forced_margin": max(margins),
               "num_non_argmax": sum(m > 0 for m in margins),
               "engine_tokens": mine, "hf_tokens": theirs,
               "hf_batched_equal": hf_batched[i] == theirs}
        if first is not None:
            # transformers' logits at the divergence (its own context = the engine's, since
            # both agree before it): how far the engine's token is from its top-1, and the
            # top-1/top-2 gap there.
            row["margin_at_divergence"] = margins[first]
            row["hf_top2_gap_at_divergence"] = top2_gap(hf, prompt + mine[:first], device)
            row["engine_token"], row["hf_token"] = mine[first], theirs[first]
        rows.append(row)
        log(f"  prompt {i} ({len(prompt)} tokens): "
            + ("equal" if first is None else
               f"diverges at token {first}: engine {mine[first]} vs hf {theirs[first]}, "
               f"hf logit margin {row['margin_at_divergence']:.4f}, "
               f"hf top-2 gap {row['hf_top2_gap_at_divergence']:.4f}")
            + f"; teacher-forced max margin {max(margins):.4f}; transformers batched "
            + ("equal to" if row["hf_batched_equal"] else "differs from") + " one-by-one")
    return {"num_prompts": len(prompts), "num_tokens": num_tokens,
            "num_equal": sum(r["equal"] for r in rows),
            "hf_batched_num_equal": sum(r["hf_batched_equal"] for r in rows), "rows": rows}


def fp32_reference_agreement(loaded: LoadedModel, prompts: list[list[int]], check: dict,
                             device: torch.device) -> dict:
    """The same weights upcast to float32 as the exact computation: teacher-forced along each
    16-bit implementation's own greedy path (transformers' and the engine's), at how many steps
    its token is the float32 argmax, and the largest float32 logit deficit of its token there.
    Flat logits make bit-for-bit equality of two 16-bit implementations a coin toss at near
    ties; this asks which of them stays closer to the exact result."""
    weights = {name: t.float() for name, t in loaded.state_dict.items()}
    hf32 = build_hf_model(LoadedModel(loaded.name, loaded.config, weights, None))
    result = {}
    for who in ("hf", "engine"):
        deficits: list[float] = []
        for prompt, row in zip(prompts, check["rows"], strict=True):
            deficits += teacher_forced_margins(hf32, prompt, row[f"{who}_tokens"], device)
        result[who] = {"steps": len(deficits), "fp32_argmax": sum(d == 0 for d in deficits),
                       "max_deficit": max(deficits), "mean_deficit": float(np.mean(deficits))}
    del hf32, weights
    release_memory(device)
    return result


class StopAfter(StoppingCriteria):
    """Stops every row once ``num_tokens`` tokens were generated (a warm-up of full shapes)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens, self.calls = num_tokens, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.calls += 1
        done = self.calls >= self.num_tokens
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def hf_generate_batch(hf, batch, device: torch.device,
                      compile_: bool) -> tuple[float, int, int, float]:
    """Left-padded static-cache greedy generation of one batch; (seconds, useful output tokens,
    padded output tokens, seconds of the untimed compile warm-up)."""
    ids, mask = left_padded([p for p, _ in batch], device)
    new = max(o for _, o in batch)
    kwargs = {"attention_mask": mask, "max_new_tokens": new, "do_sample": False,
              "pad_token_id": 0, "cache_implementation": "static",
              "disable_compile": not compile_}
    warmup_s = 0.0
    with torch.inference_mode():
        if compile_:
            # the same shapes (so the same static cache and compiled graphs), stopped early
            stop = StoppingCriteriaList([StopAfter(3)])
            warmup_s, _ = wall_s(lambda: hf.generate(ids, stopping_criteria=stop, **kwargs),
                                 device)
        elapsed, out = wall_s(lambda: hf.generate(ids, **kwargs), device)
    assert out.shape[1] == ids.shape[1] + new, out.shape
    return elapsed, sum(o for _, o in batch), len(batch) * new, warmup_s


def hf_largest_batch(hf, requests, candidates: list[int], device: torch.device,
                     compile_: bool) -> int:
    """The largest candidate batch that runs the longest prompt and output without OOM."""
    longest = max(len(p) for p, _ in requests)
    new = max(o for _, o in requests)
    for size in candidates:
        try:
            # a prompt of longest + new - 2 tokens and 2 new ones: the same static cache
            # length and a larger prefill than any real batch (a conservative probe)
            ids = torch.zeros(size, longest + new - 2, dtype=torch.long, device=device)
            with torch.inference_mode():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                            do_sample=False, pad_token_id=0, cache_implementation="static",
                            disable_compile=not compile_)
            sync(device)
            del ids
            log(f"  transformers batch {size}: fits")
            return size
        except torch.OutOfMemoryError:
            log(f"  transformers batch {size}: out of memory")
            release_memory(device)
    return candidates[-1]


def hf_baseline(hf, requests, args, device: torch.device, et: dict) -> dict:
    """transformers ``generate`` on the same requests (see the module docstring)."""
    hf_compile = not args.hf_eager and device.type == "cuda"  # transformers compiles on GPUs
    size = hf_largest_batch(hf, requests, args.hf_candidates, device, hf_compile)
    all_batches = [requests[i:i + size] for i in range(0, len(requests), size)]
    batches = all_batches[:args.hf_batches]
    hf_time = hf_useful = hf_padded = hf_warmup = 0
    for i, batch in enumerate(batches):
        t, useful, padded, warmup = hf_generate_batch(hf, batch, device, hf_compile)
        hf_time, hf_useful, hf_padded = hf_time + t, hf_useful + useful, hf_padded + padded
        hf_warmup += warmup
        log(f"  transformers batch {i}: {len(batch)} requests, {useful} useful / {padded} "
            f"generated tokens in {t:.1f}s"
            + (f" (compile warm-up before it {warmup:.1f}s)" if hf_compile else ""))
    hf_tps = hf_useful / hf_time
    return {
        "batch_size": size, "batches_timed": len(batches), "seconds": hf_time,
        "useful_output_tokens": hf_useful, "generated_tokens": hf_padded,
        "output_tokens_per_s": hf_tps,
        "all_batches": len(batches) == len(all_batches),
        "seconds_all": et["output_tokens"] / hf_tps,  # measured when all_batches
        "compiled": hf_compile, "compile_warmup_seconds": hf_warmup,
        "how": ("all batches" if len(batches) == len(all_batches) else
                f"{len(batches)} of {len(all_batches)} batches, extrapolated")
        + (f"; compiled, {hf_warmup:.0f}s of compile warm-up not counted" if hf_compile
           else "; eager"),
    }


def correctness_prompts(args: argparse.Namespace) -> list[list[int]]:
    """``--correct-prompts`` seeded random prompts (4 to 300 tokens; to 16 with ``--quick``)."""
    rng = np.random.default_rng(args.seed + 1)
    hi = 16 if args.quick else 300
    vocab = prompt_vocab(args.model)
    return [rng.integers(0, vocab, size=int(n)).tolist()
            for n in rng.integers(4, hi, size=args.correct_prompts)]


def fp32_correctness(args: argparse.Namespace, device: torch.device,
                     prompts: list[list[int]]) -> dict:
    """The same check in float32 (weights from the same seed, generated in fp32): no bf16
    rounding, so near-ties cannot flip and tokens must be equal."""
    loaded = load_model(args.model, device, torch.float32, seed=args.seed, use_cache=False)
    llm = LLM(model=args.model, device=args.device, dtype="float32",
              max_num_seqs=len(prompts), max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, num_kv_blocks=1024,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager, seed=args.seed,
              loaded=loaded)
    hf = build_hf_model(loaded)
    hf.generation_config.eos_token_id = None
    log(f"correctness (float32): {len(prompts)} prompts x {args.correct_tokens} greedy "
        f"tokens, {len(llm.engine.runner.graph_sizes)} decode graphs")
    result = check_correctness(llm, hf, prompts, args.correct_tokens, device)
    del llm, hf, loaded
    release_memory(device)
    return result


def check_dtype(args: argparse.Namespace, llm: LLM, hf, loaded: LoadedModel,
                prompts: list[list[int]], device: torch.device, corr: dict) -> None:
    """Correctness in the run's dtype (again with the embedding scaled on a divergence when
    ``--retry-embed-scale``), into ``corr``."""
    log(f"correctness ({args.dtype}): {len(prompts)} prompts x {args.correct_tokens} "
        f"greedy tokens")
    corr[args.dtype] = check_correctness(llm, hf, prompts, args.correct_tokens, device)
    if corr[args.dtype]["num_equal"] < len(prompts) and args.retry_embed_scale:
        embed = loaded.state_dict["model.embed_tokens.weight"]
        log(f"correctness again with the embedding scaled by {EMBED_SCALE:g}")
        embed.mul_(EMBED_SCALE)
        try:
            corr[f"{args.dtype}_embed_x16"] = check_correctness(
                llm, hf, prompts, args.correct_tokens, device)
        finally:
            embed.div_(EMBED_SCALE)
