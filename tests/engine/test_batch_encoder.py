"""Batched tokenization for the event loop, and the pinned-prefix split and pinned texts it
serves."""

import asyncio
import threading

import pytest

from engine.batch_encoder import INLINE_CHARS, BatchEncoder
from engine.chat import (
    PinnedTexts,
    chat_text,
    continue_pinned,
    decode_concatenates,
    render_chat,
)
from engine.loader import load_tokenizer
from tests.engine.conftest import CHAT_PROMPTS, conversations

# long enough to go to the worker thread
TEXTS = [(prompt + " ") * (INLINE_CHARS // len(prompt) + 1) for prompt in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


class CountingTokenizer:
    """A tokenizer that records every batch it is called with, and in which thread."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.batches: list[list[str]] = []
        self.threads: set[int] = set()

    def __call__(self, texts: list[str], add_special_tokens: bool) -> dict:
        self.batches.append(list(texts))
        self.threads.add(threading.get_ident())
        return self.inner(texts, add_special_tokens=add_special_tokens)


def test_batch_encoder_returns_what_encode_returns_in_one_call_per_burst(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    encoder = BatchEncoder(counting)

    async def burst() -> list[list[int]]:
        return await asyncio.gather(*(encoder.encode(t) for t in TEXTS))

    got = asyncio.run(burst())
    assert got == [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert counting.batches == [TEXTS]
    assert threading.get_ident() not in counting.threads


def test_short_texts_are_encoded_on_the_spot(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    encoder = BatchEncoder(counting)
    short = CHAT_PROMPTS[0]
    assert len(short) <= INLINE_CHARS
    assert asyncio.run(encoder.encode(short)) == tokenizer.encode(short,
                                                                   add_special_tokens=False)
    assert counting.threads == {threading.get_ident()}


def test_texts_queued_while_a_batch_runs_go_into_the_next_batch(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    release = threading.Event()

    def blocking(texts: list[str], add_special_tokens: bool) -> dict:
        if not counting.batches:
            release.wait(10)
        return counting(texts, add_special_tokens)

    encoder = BatchEncoder(blocking)

    async def scenario() -> list[list[int]]:
        first = asyncio.create_task(encoder.encode(TEXTS[0]))
        await asyncio.sleep(0.05)  # the first batch is now in the worker thread
        later = [asyncio.create_task(encoder.encode(t)) for t in TEXTS[1:3]]
        await asyncio.sleep(0.05)
        release.set()
        return [await first] + [await t for t in later]

    got = asyncio.run(scenario())
    assert got == [tokenizer.encode(t, add_special_tokens=False)
                   for t in TEXTS[:3]]
    assert counting.batches == [TEXTS[:1], TEXTS[1:3]]


def test_batch_encoder_survives_a_cancelled_caller_and_a_failing_batch(tokenizer) -> None:
    class Failing:
        def __call__(self, texts: list[str], add_special_tokens: bool) -> dict:
            raise RuntimeError("tokenizer broke")

    async def scenario() -> None:
        encoder = BatchEncoder(tokenizer)
        first = asyncio.create_task(encoder.encode(TEXTS[0]))
        second = asyncio.create_task(encoder.encode(TEXTS[1]))
        third = asyncio.create_task(encoder.encode(TEXTS[2]))
        await asyncio.sleep(0)
        second.cancel()
        assert await first == tokenizer.encode(TEXTS[0], add_special_tokens=False)
        assert await third == tokenizer.encode(TEXTS[2], add_special_tokens=False)
        assert second.cancelled()
        assert await encoder.encode("") == []

        broken = BatchEncoder(Failing())
        with pytest.raises(RuntimeError, match="tokenizer broke"):
            await broken.encode(TEXTS[3])
        broken.tokenizer = tokenizer  # a later batch runs again
        assert await broken.encode(TEXTS[3]) == tokenizer.encode(TEXTS[3], add_special_tokens=False)

    asyncio.run(scenario())


def test_continue_pinned_keeps_the_pinned_ids_up_to_where_the_text_diverges(tokenizer) -> None:
    answer = "Paris. 🌍 Bien sûr !"
    chat = conversations()[0] + [{"role": "assistant", "content": answer}]
    # what a finished turn pins: its prompt and the answer's tokens
    pinned = (render_chat(tokenizer, chat[:-1], None)
              + tokenizer.encode(answer, add_special_tokens=False))
    follow_up = chat + [{"role": "user", "content": "And of Italy?"}]
    text = chat_text(tokenizer, follow_up)

    kept, rest = continue_pinned(tokenizer, text, pinned)
    assert kept == pinned and text == tokenizer.decode(kept) + rest

    edited = chat[:-1] + [{"role": "assistant", "content": "Lyon. 🌍 Bien sûr !"}]
    edited_text = chat_text(tokenizer, edited)
    kept, rest = continue_pinned(tokenizer, edited_text, pinned)
    assert 0 < len(kept) < len(pinned) and kept == pinned[:len(kept)]
    assert edited_text.startswith(tokenizer.decode(kept))
    assert not edited_text.startswith(tokenizer.decode(pinned[:len(kept) + 1]))
    assert edited_text == tokenizer.decode(kept) + rest

    assert continue_pinned(tokenizer, text, None) == ([], text)
    assert continue_pinned(tokenizer, "unrelated", pinned) == ([], "unrelated")


def test_pinned_texts_decode_only_the_answer_and_equal_a_whole_decode(tokenizer) -> None:
    chat = conversations()[1]
    text = chat_text(tokenizer, chat)
    prompt = render_chat(tokenizer, chat, None)
    # an answer cut inside a multi-byte character, as a pin can be (its last token uncomputed)
    answer = tokenizer.encode(" La mer 🌊 brille", add_special_tokens=False)
    texts = PinnedTexts(tokenizer)
    texts.remember("s", prompt, text)
    for cut in range(len(answer) + 1):
        pinned = prompt + answer[:cut]
        assert texts.text("s", pinned) == tokenizer.decode(pinned)

    other = render_chat(tokenizer, conversations()[2], None)  # does not extend the prompt
    assert texts.text("s", other) == tokenizer.decode(other)
    assert texts.text("never-rendered", prompt) == tokenizer.decode(prompt)
    texts.forget("s")
    assert texts._prompts == {}


def test_decode_concatenates_holds_for_byte_level_bpe_not_sentencepiece(tokenizer) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "▁Hello", "▁world,", "▁café", "▁🌊"]
    metaspace = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    metaspace.decoder = decoders.Metaspace()
    sentencepiece_like = PreTrainedTokenizerFast(tokenizer_object=metaspace)

    assert decode_concatenates(tokenizer)
    assert not decode_concatenates(sentencepiece_like)
    texts = PinnedTexts(sentencepiece_like)
    texts.remember("s", [1], "Hello")
    assert texts._prompts == {}  # never trusted: every text is a whole decode
    assert texts.text("s", [1, 2]) == sentencepiece_like.decode([1, 2])
