"""The repetition guard: recognises an output stuck in a loop, its tail one n-gram repeated
back to back."""

MIN_SPAN = 48  # tokens the copies must fill at least
MIN_REPEATS = 3  # copies at least
MAX_NGRAM = 64  # tokens in the repeated n-gram at most


def loops(token_ids: list[int], num_output_tokens: int) -> bool:
    """Whether the output (the last ``num_output_tokens`` of ``token_ids``) ends in one n-gram
    of at most ``MAX_NGRAM`` tokens repeated back to back, the copies (the first may be
    partial) filling the last ``max(MIN_SPAN, MIN_REPEATS * n)`` tokens."""
    if num_output_tokens < MIN_SPAN:
        return False
    last = token_ids[-1]
    for n in range(1, MAX_NGRAM + 1):
        span = max(MIN_SPAN, MIN_REPEATS * n)
        if span > num_output_tokens:
            break
        if token_ids[-1 - n] == last and token_ids[n - span:] == token_ids[-span:-n]:
            return True
    return False
