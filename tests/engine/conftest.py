"""Shared fixtures: the real SmolLM2 model and transformers' greedy output as the oracle."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import build_hf_model, load_model

MAX_NEW_TOKENS = 64

SYSTEM = ("You are a meticulous assistant for a small engineering team. Answer precisely, "
          "prefer short sentences, show code in fenced blocks, and say when you are unsure.")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Écris un court poème sur la mer 🌊 et les étoiles ✨.",
    "写一首关于春天的短诗。",
    "Explain paged attention in one paragraph.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning, my friend' into Spanish, German and Japanese (日本語).",
    "Write a Python function that reverses a linked list.",
    "Hi!",
    "What does the emoji 🤖 usually mean in a chat? And 👩‍👩‍👧?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Почему небо голубое? Ответь кратко.",
    "Give me a haiku about GPUs.",
    "What is 17 * 23? Show your steps.",
    "Describe a cat to someone who has never seen one. " * 6,
    "¿Cuál es la diferencia entre 'ser' y 'estar'?",
    "Write a SQL query that counts orders per customer, then explain each clause of it in "
    "detail, including GROUP BY, ORDER BY and how NULL values are handled. " * 3,
]


def conversations() -> list[list[dict]]:
    """16 chat prompts of mixed length, some with a system prompt."""
    convs = []
    for i, text in enumerate(CHAT_PROMPTS):
        conv = [{"role": "user", "content": text}]
        if i % 3 == 0:
            conv.insert(0, {"role": "system", "content": SYSTEM})
        convs.append(conv)
    return convs


@pytest.fixture(scope="session")
def smollm2():
    return load_model("smollm2", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def prompt_ids(smollm2) -> list[list[int]]:
    tok = smollm2.tokenizer
    return [tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True,
                                    return_dict=False) for c in conversations()]


@pytest.fixture(scope="session")
def hf_greedy(smollm2, prompt_ids) -> list[list[int]]:
    """transformers' ``generate(do_sample=False)``, one prompt at a time (no padding),
    ``MAX_NEW_TOKENS`` tokens each."""
    model = build_hf_model(smollm2)
    model.generation_config.eos_token_id = None  # run past EOS like ignore_eos=True
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def llm() -> LLM:
    """One default engine per test module (the weight cache makes loading quick)."""
    return LLM("smollm2")


FORCED_CHATS = ("What is the capital of France?", "Write a haiku about the sea.",
                "Explain what a hash map is.", "List three prime numbers.")


def teacher_forced_agreement(candidate: LLM, num_tokens: int = 16) -> float:
    """The share of positions where ``candidate``'s greedy token, fed the exact engine's greedy
    path (float32, float32 KV cache) so far, is the exact engine's token: ``FORCED_CHATS``,
    ``num_tokens`` tokens each."""
    exact = LLM("smollm2", max_model_len=512, num_kv_blocks=256)
    prompts = [exact.engine.render_chat([{"role": "user", "content": c}]) for c in FORCED_CHATS]
    greedy = SamplingParams(temperature=0.0, max_tokens=num_tokens)
    reference = [o.outputs[0].token_ids for o in exact.generate(prompts, greedy)]
    del exact
    forced = [p + r[:t] for p, r in zip(prompts, reference, strict=True) for t in range(len(r))]
    outs = candidate.generate(forced, SamplingParams(temperature=0.0, max_tokens=1))
    chosen = [o.outputs[0].token_ids[0] for o in outs]
    expected = [token for r in reference for token in r]
    return sum(a == b for a, b in zip(chosen, expected, strict=True)) / len(expected)
