"""Incremental detokenization of one output sequence, with OpenAI-style stop strings."""

import functools
from collections.abc import Callable
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream


class Tokenizer(Protocol):
    """What the detokenizer needs from a (Hugging Face) tokenizer."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


# Text on which the "clean up tokenization spaces" post-processing (" ," -> "," and the like)
# would change what a tokenizer's decode returns.
_CLEANUP_PROBE = "a , b . c ! d ? e 's f n't g 'm h 've i 're j"


@functools.cache
def rust_backend(tokenizer: Tokenizer) -> Any:
    """The tokenizer's Rust backend (a ``tokenizers.Tokenizer``) when its decode is the
    tokenizer's own (a fast tokenizer whose decode applies no space clean-up, as checked on a
    probe that the clean-up would change), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        probe = backend.encode(_CLEANUP_PROBE, add_special_tokens=False).ids
        if backend.decode(probe, skip_special_tokens=True) == tokenizer.decode(
                probe, skip_special_tokens=True):
            return backend
    return None


def decoder(tokenizer: Tokenizer) -> Callable[[list[int], bool], str]:
    """``tokenizer.decode(ids, skip_special_tokens=...)`` as a function: straight from the Rust
    backend where it is the same (``rust_backend``), which saves the ~10 µs of Python around
    each call."""
    backend = rust_backend(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    """Turns the token ids of one output sequence into text as they arrive.

    Invariants:

    - the chunks returned by :meth:`append` and :meth:`flush`, concatenated, equal
      ``tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)`` cut just before
      the stop string that completes first (and :attr:`text` is that concatenation);
    - released text is never taken back: a chunk never ends inside a UTF-8 character (byte-level
      or byte-fallback tokens wait for the rest of their character), never contains a stop
      string, and text that could be the start of one is held back until it cannot be;
    - each call decodes a small window (vLLM's prefix/read offsets): the ids since the last clean
      character boundary plus those of the previous release, for the tokenizer's spacing context.
      With a Rust backend (``rust_backend``) that window is kept by ``tokenizers``' own
      ``DecodeStream``, one call a token; otherwise here, two decodes a token.

    ``prompt_token_ids`` is deliberately not used as decoding context, so that the text equals
    the decode of the output ids alone for every tokenizer (SentencePiece ones strip the first
    output token's leading space, and a prompt cut mid-character would change the first bytes).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._decode_ids = decoder(tokenizer)
        self._backend = rust_backend(tokenizer)
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens)
                        if self._backend is not None else None)
        self._streamed = 0  # characters of the decode the stream has returned
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: ids whose text was already released, as context
        self._read_offset = 0  # ids before this are decoded into released or held text
        self._prefix_text = ""  # decode of ids[prefix_offset:read_offset]
        self._held = ""  # decoded text withheld because it could start a stop string
        self._text = ""
        self._stop_reason: str | None = None

    @property
    def text(self) -> str:
        """The text released so far (stop string and held-back text excluded)."""
        return self._text

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, or None while none has occurred."""
        return self._stop_reason

    def append(self, token_id: int) -> str:
        """Add the next output token; return the text it makes releasable (often "").

        After a stop string was hit nothing more is released.
        """
        if self._stop_reason is not None:
            return ""
        self._ids.append(token_id)
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id)
            if delta is None:
                return ""  # nothing new yet, or the last character is still incomplete
            self._streamed += len(delta)
            return self._release(delta)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new yet, or the last character is still incomplete
        return self._release(self._advance(new_text))

    def flush(self) -> str:
        """Release everything still pending at the end of the sequence: an incomplete trailing
        character (as the decoder renders it) and held-back text. Nothing after a stop."""
        if self._stop_reason is not None:
            return ""
        if self._stream is not None:  # what the stream holds back: the decode's rest
            out = self._release(self._decode(0)[self._streamed:])
        else:
            out = self._release(self._advance(self._decode(self._prefix_offset)))
        if self._stop_reason is None:
            out += self._held
            self._text += self._held
            self._held = ""
        return out

    def _decode(self, start: int) -> str:
        return self._decode_ids(self._ids[start:], self._skip_special_tokens)

    def _advance(self, new_text: str) -> str:
        """Return the text of ``ids[read_offset:]`` (given the window's decode ``new_text``) and
        move the window so that its context is the ids just decoded."""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_text = self._decode(self._read_offset)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return delta

    def _release(self, delta: str) -> str:
        """Append decoded ``delta`` to the held text; return what can be released for good."""
        if not self._stop:
            self._text += delta
            return delta
        pending = self._held + delta
        # The stop string that completes first (as if text came a character at a time) wins;
        # of two completing together, the longer one (it starts earlier).
        hits = [(i + len(s), i, s) for s in self._stop if (i := pending.find(s)) >= 0]
        if hits:
            _, at, self._stop_reason = min(hits)
            out, self._held = pending[:at], ""
        else:
            keep = self._stop_prefix_len(pending)
            out, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._text += out
        return out

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a (proper) prefix of a stop string."""
        longest = min(len(text), max(len(s) for s in self._stop) - 1)
        for n in range(longest, 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
