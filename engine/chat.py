"""Chat prompts as token ids, continuing a session's pinned tokens where they still fit.

Rendering is two steps so that a server can run them in different places: :func:`chat_text`
and :func:`continue_pinned` are cheap (the template, a decode of the pinned ids, which
:class:`PinnedTexts` cuts to the ids pinned since the session's last rendered prompt) and the
encoding of what remains is the expensive part (see ``engine.batch_encoder``).
"""

import functools
from typing import Any

from engine.detokenizer import decoder


def chat_text(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The chat template with the generation prompt, as text; ``tools`` (OpenAI function
    definitions) go to a template that renders them (:func:`supports_tools`)."""
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True)


@functools.cache
def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(template.values())
    return isinstance(template, str) and "tools" in template


def continue_pinned(tokenizer: Any, text: str, pinned: list[int] | None,
                    pinned_text: str | None = None) -> tuple[list[int], str]:
    """Split ``text`` into the longest run of ``pinned`` whose decoded text prefixes it, and
    the rest of ``text``, still to be tokenized. Keeping the pinned ids as they are (rather
    than tokenizing the whole text again) makes the turn continue the pinned KV exactly: a next
    turn keeps everything, a regenerate or an edit keeps up to the divergence. The common case
    costs one decode, or none given ``pinned_text`` (the decode of ``pinned``); ``pinned`` is
    never modified."""
    if not pinned:
        return [], text
    decode = decoder(tokenizer)
    whole = decode(pinned, False) if pinned_text is None else pinned_text
    if text.startswith(whole):
        return list(pinned), text[len(whole):]
    lo, hi, kept_text = 0, len(pinned) - 1, ""
    while lo < hi:  # the longest k with decode(pinned[:k]) a prefix of text
        mid = (lo + hi + 1) // 2
        piece = decode(pinned[:mid], False)
        if text.startswith(piece):
            lo, kept_text = mid, piece
        else:
            hi = mid - 1
    return pinned[:lo], text[len(kept_text):]


def render_chat(tokenizer: Any, messages: list[dict], pinned: list[int] | None) -> list[int]:
    """Chat template + generation prompt as token ids, continuing ``pinned`` (the token ids a
    session has pinned) where they still fit; see :func:`continue_pinned`."""
    kept, rest = continue_pinned(tokenizer, chat_text(tokenizer, messages), pinned)
    return kept + tokenizer.encode(rest, add_special_tokens=False)


@functools.cache
def decode_concatenates(tokenizer: Any) -> bool:
    """Whether ``decode(a + b) == decode(a) + decode(b)`` wherever ``decode(a)`` ends on a whole
    character: true of byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen2), false of SentencePiece,
    whose decode drops the leading space of ``b``; checked on a probe."""
    decode = decoder(tokenizer)
    a = tokenizer.encode("Hello", add_special_tokens=False)
    b = tokenizer.encode(" world, café 🌊", add_special_tokens=False)
    return decode(a + b, False) == decode(a, False) + decode(b, False)


class PinnedTexts:
    """The decoded text of a session's pinned ids, at the cost of decoding only what was pinned
    after the session's last rendered prompt (its answer) instead of the whole conversation.

    Holds each session's last rendered prompt (ids and text) from :meth:`remember` until
    :meth:`forget`. Used only where decoding concatenates (:func:`decode_concatenates`); the
    text of ids that do not extend the remembered prompt is decoded whole."""

    def __init__(self, tokenizer: Any) -> None:
        self._decode = decoder(tokenizer)
        self._enabled = decode_concatenates(tokenizer)
        self._prompts: dict[str, tuple[list[int], str]] = {}

    def remember(self, session_id: str, prompt_ids: list[int], text: str) -> None:
        """``prompt_ids`` were rendered from ``text`` (so decode to it) for ``session_id``."""
        if self._enabled:
            self._prompts[session_id] = (prompt_ids, text)

    def forget(self, session_id: str) -> None:
        self._prompts.pop(session_id, None)

    def text(self, session_id: str, pinned: list[int]) -> str:
        prompt = self._prompts.get(session_id)
        if prompt is not None:
            ids, text = prompt
            if len(pinned) >= len(ids) and pinned[:len(ids)] == ids:
                return text + self._decode(pinned[len(ids):], False)
        return self._decode(pinned, False)
