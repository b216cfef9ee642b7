"""The repetition guard: recognises an output stuck in a loop, its tail one n-gram repeated
back to back."""

MIN_SPAN = 48  # tokens the copies must fill at least
MIN_REPEATS = 3  # copies at least
MAX_NGRAM = 64  # tokens in the repeated n-gram at most


def loops(token_ids: list[int], num_output_tokens: int) -> bool:
    """Whether the output (the last ``num_output_tokens`` of ``token_ids``) ends in one n-gram
    of at most ``MAX_NGRAM`` tokens repeated back to back, the copies (the first may be
    partial) filling the last ``max(MIN_SPAN, MIN_REPEATS * n)`` tokens.

    Called for every token of every guarded sequence: the n-gram lengths worth comparing are
    those ``n`` whose token ``n`` back equals the last one, found by C-level scans of the
    reversed window (one or two for an output that does not loop) rather than by a Python loop
    over every ``n``."""
    if num_output_tokens < MIN_SPAN:
        return False
    last = token_ids[-1]
    longest = min(MAX_NGRAM, num_output_tokens // MIN_REPEATS)  # n whose span fits the output
    back = token_ids[-2:-2 - longest:-1]  # back[n - 1] is the token n before the last
    n = 0
    while True:
        try:
            n = back.index(last, n) + 1
        except ValueError:
            return False
        span = max(MIN_SPAN, MIN_REPEATS * n)
        if token_ids[n - span:] == token_ids[-span:-n]:
            return True
