"""Bad input raises ValueError naming the parameter and the limit, and leaves
no block allocated."""

import pytest

from engine import LLM, SamplingParams


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "max_tokens must be at least 1"),
    ({"max_tokens": -3}, "max_tokens must be at least 1"),
    ({"temperature": -0.5}, r"temperature must be in \[0, 2\]"),
    ({"temperature": 3.0}, r"temperature must be in \[0, 2\]"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"n": 0}, "n must be at least 1"),
    ({"top_k": -1}, "top_k"),
    ({"logprobs": 50}, r"logprobs must be in \[0, 20\]"),
])
def test_sampling_params_are_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompts_are_validated_and_a_bad_one_leaves_none_of_its_batch_behind() -> None:
    llm = LLM("smollm2", max_model_len=256, num_kv_blocks=64)
    good = [1, 2, 3]
    long_good = list(range(100))  # several blocks once it runs
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([good, long_good, []], SamplingParams(max_tokens=4, n=2))
    with pytest.raises(ValueError, match="prompt has 300 tokens, max_model_len is 256"):
        llm.generate([good, list(range(300))], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 49152\)"):
        llm.generate([[49152]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 49152\)"):
        llm.generate([good, good], [SamplingParams(max_tokens=4),
                                    SamplingParams(max_tokens=4, logit_bias={49152: 1.0})])
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens, max_model_len is 256"):
        llm.chat([[{"role": "user", "content": "Hi."}],
                  [{"role": "user", "content": "word " * 300}]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="got 2 sampling params for 1 prompts"):
        llm.generate([good], [SamplingParams(), SamplingParams()])
    assert llm.engine.requests == {}
    stats = llm.stats()
    assert stats.num_blocks_used == 0
    assert stats.num_requests_waiting == stats.num_requests_running == 0
    # the engine still serves after the errors
    assert len(llm.generate([good], SamplingParams(max_tokens=4, ignore_eos=True))[0]
               .outputs[0].token_ids) == 4


@pytest.mark.parametrize("model", ["/nonexistent/model/folder", "no-such-model", "dummy:nope"])
def test_unknown_model_names_the_argument(model: str) -> None:
    with pytest.raises(ValueError, match="model"):
        LLM(model)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"block_size": 12}, r"block_size must be one of \(8, 16, 32\)"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"max_model_len": 10**6}, "max_model_len 1000000 exceeds"),
])
def test_engine_arguments_are_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM("smollm2", **kwargs)
