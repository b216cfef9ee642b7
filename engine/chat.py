"""Chat prompts as token ids, continuing a session's pinned tokens where they still fit.

Rendering is two steps so that a server can run them in different places: :func:`chat_text`
and :func:`continue_pinned` are cheap (the template, one decode of the pinned ids) and the
encoding of what remains is the expensive part (see ``engine.batch_encoder``).
"""

from typing import Any

from engine.detokenizer import decoder


def chat_text(tokenizer: Any, messages: list[dict]) -> str:
    """The chat template with the generation prompt, as text."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def continue_pinned(tokenizer: Any, text: str, pinned: list[int] | None
                    ) -> tuple[list[int], str]:
    """Split ``text`` into the longest run of ``pinned`` whose decoded text prefixes it, and
    the rest of ``text``, still to be tokenized. Keeping the pinned ids as they are (rather
    than tokenizing the whole text again) makes the turn continue the pinned KV exactly: a next
    turn keeps everything, a regenerate or an edit keeps up to the divergence. The common case
    costs one decode; ``pinned`` is never modified."""
    if not pinned:
        return [], text
    decode = decoder(tokenizer)
    whole = decode(pinned, False)
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
