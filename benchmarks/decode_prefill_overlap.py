"""Does a decode step's attention hide under a prefill's GEMMs when the two run side by side?

The 256-row decode step reads its KV cache at copy bandwidth while its GEMMs are compute-bound,
one after the other (each layer's attention needs its q/k/v GEMM and feeds its o GEMM). A
prefill's rows are independent of the decode rows, so a mixed step could replay the decode
graph on a second stream beside the prefill forward and hide the decode rows' KV reads under
the prefill's GEMMs. This measures how much of that happens on the GPU: for decode contexts
``--decode-ctx`` and prefill sizes ``--prefill-tokens``, the decode graph replay alone, the
prefill forward alone (eager, with its sampled rows' logits), the two one after the other on
one stream, and the two on two streams (CUDA events, median of three rounds of medians).

    PYTHONUNBUFFERED=1 python benchmarks/decode_prefill_overlap.py     # H200: dummy:llama-3.1-8b

Prints a table last; ``saved`` is serial minus two streams.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks import gpu_e2e  # noqa: E402
from engine.model import AttentionMetadata  # noqa: E402


def prefill_call(llm, first_block: int, tokens: int, seqs: int, device: torch.device):
    """An eager prefill forward of ``seqs`` fresh sequences of ``tokens / seqs`` tokens in
    blocks from ``first_block`` on, with its last rows' logits."""
    runner, model = llm.engine.runner, llm.engine.runner.model
    bs, per = runner.block_size, tokens // seqs
    nblk = -(-per // bs)
    tables = (torch.arange(seqs * nblk, device=device, dtype=torch.int32).view(seqs, nblk)
              + first_block)
    offsets = torch.arange(per, device=device)
    meta = AttentionMetadata(
        slot_mapping=(tables.long()[:, offsets // bs] * bs + offsets % bs).flatten(),
        block_tables=tables, seq_lens=torch.full((seqs,), per, device=device, dtype=torch.int32),
        query_start_loc=torch.arange(0, seqs * per + 1, per, device=device, dtype=torch.int32),
        max_query_len=per, max_seq_len=per)
    ids = torch.randint(0, model.embed.shape[0], (seqs * per,), device=device)
    positions = offsets.repeat(seqs)

    def prefill() -> None:
        hidden = model.forward(ids, positions, meta, runner.kv_cache)
        model.compute_logits(hidden[meta.query_start_loc[1:] - 1])
    return prefill


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--decode-ctx", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    e2e_args = gpu_e2e.parse_args(["--no-hf", "--no-fp32-check"])
    loaded = gpu_e2e.load_model(e2e_args.model, device, torch.bfloat16, seed=0, use_cache=False)
    llm = gpu_e2e.start_engine(e2e_args, loaded, {})
    runner = llm.engine.runner
    copy_bw = gpu_e2e.copy_bandwidth(device)
    side, main_stream = torch.cuda.Stream(), torch.cuda.current_stream()
    rows = []
    with torch.inference_mode():
        for ctx in args.decode_ctx:
            # fills the graph's static buffers: rows in blocks 1 .. batch * ceil(ctx / bs)
            gpu_e2e.decode_step_roofline(llm, args.decode_batch, ctx, copy_bw, device)
            graph = runner.graphs[args.decode_batch][0]
            first_free = args.decode_batch * -(-ctx // runner.block_size) + 1
            for tokens in args.prefill_tokens:
                prefill = prefill_call(llm, first_free, tokens, max(1, tokens // 512), device)

                def serial(prefill=prefill, graph=graph) -> None:
                    graph.replay()
                    prefill()

                def two_streams(prefill=prefill, graph=graph) -> None:
                    side.wait_stream(main_stream)
                    with torch.cuda.stream(side):
                        graph.replay()
                    prefill()
                    main_stream.wait_stream(side)

                ways = {"decode": graph.replay, "prefill": prefill, "serial": serial,
                        "two streams": two_streams}
                for fn in ways.values():
                    fn()
                torch.cuda.synchronize()
                ms = {name: 1e3 * float(np.median([gpu_e2e.cuda_median_s(fn, reps=5)
                                                   for _ in range(3)]))
                      for name, fn in ways.items()}
                rows.append((ctx, tokens, ms))
                gpu_e2e.log(f"ctx {ctx}, prefill {tokens}: {ms}")
    print(f"\n{torch.cuda.get_device_name()}; {e2e_args.model}; decode batch "
          f"{args.decode_batch} (CUDA graph), prefill eager; ms")
    print(f"{'ctx':>5} {'prefill':>8} {'decode':>8} {'prefill':>8} {'serial':>8} "
          f"{'2 streams':>10} {'saved':>7}")
    for ctx, tokens, ms in rows:
        print(f"{ctx:>5} {tokens:>8} {ms['decode']:>8.2f} {ms['prefill']:>8.2f} "
              f"{ms['serial']:>8.2f} {ms['two streams']:>10.2f} "
              f"{ms['serial'] - ms['two streams']:>7.2f}")


if __name__ == "__main__":
    main()
