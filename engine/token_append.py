"""Appending a sampled token to its sequence: its logprob, its text, and the checks that finish
the sequence (end of sequence, stop tokens and strings, lengths, a complete grammar, a loop)."""

from typing import Any

from engine.grammars import Grammars
from engine.outputs import TokenLogprob
from engine.repetition import loops
from engine.request import Request
from engine.sequence import Sequence


def append_token(request: Request, seq: Sequence, token_id: int, logprob: TokenLogprob | None,
                 eos_token_ids: set[int], max_model_len: int, grammars: Grammars) -> bool:
    """Append ``token_id`` to ``seq`` (of ``request``), its text to the request's unsent text,
    and set ``seq``'s finish (and stop) reason if the token finishes it, flushing its text;
    whether it did."""
    seq.token_ids.append(token_id)
    if seq.logprobs is not None and logprob is not None:
        seq.logprobs.append(logprob)
        seq.cumulative_logprob += logprob.logprob
    detok = request.detokenizers[seq.index]
    params = seq.params
    if not params.ignore_eos and token_id in eos_token_ids:
        seq.finish_reason = "stop"
    elif token_id in params.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", token_id
    else:
        if detok is not None:
            request.unsent_text[seq.index] += detok.append(token_id)
        if detok is not None and detok.stop_reason is not None:
            seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = "length"
        elif seq.num_tokens >= max_model_len:
            seq.finish_reason = "length"
        elif grammars.ends(seq, token_id):
            seq.finish_reason = "stop"  # the grammar is complete
        elif (params.repetition_guard and seq.matcher is None  # (a grammar bounds its own)
              and loops(seq.token_ids, seq.num_output_tokens)):
            seq.finish_reason = "repetition"
    if seq.finish_reason is None:
        return False
    if detok is not None and detok.stop_reason is None:
        request.unsent_text[seq.index] += detok.flush()
    return True


def eos_token_ids(*sources: Any) -> set[int]:
    """The end-of-sequence token ids of a model's config and tokenizer (``eos_token_id``: an
    int or a list; a source may be None)."""
    ids: set[int] = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(eos)
    return ids
