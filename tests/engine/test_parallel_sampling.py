"""``n`` samples share the prompt's blocks (the partial last block included)
until they write into them (copy-on-write), and each equals its seed run alone."""

from engine import LLM, SamplingParams

PROMPT = [[300 + (i * 7) % 900 for i in range(75)]]  # 4 full blocks + a partial one (bs 16)


def _peak_blocks(llm: LLM, params: SamplingParams) -> tuple[int, list[list[int]]]:
    engine = llm.engine
    engine.add_request("r", PROMPT[0], params, final_only=True)
    peak = 0
    outputs = None
    while engine.has_unfinished():
        for out in engine.step():
            outputs = out
        peak = max(peak, engine.kv.pool.num_used)
    assert outputs is not None and outputs.finished
    return peak, [o.token_ids for o in outputs.outputs]


def test_samples_share_blocks_until_they_write() -> None:
    llm = LLM("smollm2", num_kv_blocks=256)
    engine = llm.engine
    engine.add_request("fork", PROMPT[0], SamplingParams(n=4, temperature=0.8, seed=7,
                                                         max_tokens=4))
    engine.step()  # prefill the prompt once, fork, sample each child's first token
    seqs = engine.requests["fork"].seqs
    tables = [s.block_table for s in seqs]
    assert all(t == tables[0] for t in tables)  # every block shared, the partial one too
    partial = engine.kv.pool.blocks[tables[0][-1]]
    assert partial.ref_cnt == 4
    engine.step()  # each child writes its token into the partial block: 3 copies, 1 in place
    last_blocks = {s.block_table[-1] for s in seqs}
    assert len(last_blocks) == 4
    assert all(s.block_table[:-1] == tables[0][:-1] for s in seqs)  # full blocks still shared
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.pool.num_used == 0


def test_block_usage_and_samples_match_single_runs() -> None:
    llm = LLM("smollm2", num_kv_blocks=256, enable_prefix_caching=False)
    params = dict(temperature=0.8, max_tokens=24, ignore_eos=True)
    peak_four, samples = _peak_blocks(llm, SamplingParams(n=4, seed=11, **params))
    peak_one, _ = _peak_blocks(llm, SamplingParams(n=1, seed=11, **params))
    assert peak_four < 4 * peak_one
    for index, sample in enumerate(samples):
        alone = llm.generate(PROMPT, SamplingParams(n=1, seed=11 + index, **params))[0]
        assert alone.outputs[0].token_ids == sample, f"sample {index}"
    assert len({tuple(s) for s in samples}) > 1  # they really are different samples
