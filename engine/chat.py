"""Chat prompts as token ids, continuing a session's pinned tokens where they still fit."""

from typing import Any


def render_chat(tokenizer: Any, messages: list[dict], pinned: list[int] | None) -> list[int]:
    """Chat template + generation prompt as token ids. With the token ids a session has pinned,
    the longest run of them whose text prefixes the rendering is kept as it is and only the rest
    is tokenized, so the turn continues the pinned KV exactly (a next turn keeps everything; a
    regenerate or edit keeps up to the divergence). ``pinned`` is never modified."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    kept = _pinned_text_prefix(tokenizer, pinned, text) if pinned else []
    kept_text = tokenizer.decode(kept, skip_special_tokens=False)
    return kept + tokenizer.encode(text[len(kept_text):], add_special_tokens=False)


def _pinned_text_prefix(tokenizer: Any, token_ids: list[int], text: str) -> list[int]:
    """The longest ``token_ids[:k]`` whose decoded text is a prefix of ``text``."""
    def decoded(k: int) -> str:
        return tokenizer.decode(token_ids[:k], skip_special_tokens=False)

    if text.startswith(decoded(len(token_ids))):
        return list(token_ids)
    lo, hi = 0, len(token_ids)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(decoded(mid)):
            lo = mid
        else:
            hi = mid - 1
    return token_ids[:lo]
