"""The text of a request's delta outputs, made on the engine's client side.

The engine process appends every sampled token of every running sequence in one thread, so
each microsecond a token costs there is a microsecond of every step. Detokenizing is the
largest such cost that needs only the token ids, so a client (``AsyncEngine``, in each gateway
process: vLLM's front-end detokenizer) asks the engine for ids only (``detokenize=False``) and
makes the text itself. Stop strings must end a sample where they occur, which takes the text in
the engine: a request with stop strings is detokenized there as before.
"""

from engine.detokenizer import IncrementalDetokenizer, Tokenizer
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class OutputText:
    """Fills in the text of one request's delta outputs, sent without text, from their token ids.

    Invariant: each text is what the engine would have sent with ``detokenize=True``. The engine
    adds no text for a token that ends a sample as an end-of-sequence token (unless
    ``ignore_eos``) or a stop token, and such a token can only be a sample's last; it releases the
    rest of a sample's text when the sample finishes, except by an abort."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams,
                 eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._no_text = frozenset(params.stop_token_ids).union(
            () if params.ignore_eos else eos_token_ids)
        self._samples: dict[int, IncrementalDetokenizer] = {}

    def fill(self, output: RequestOutput) -> None:
        no_text = self._no_text
        for completion in output.outputs:
            detok = self._samples.get(completion.index)
            if detok is None:
                detok = self._samples[completion.index] = IncrementalDetokenizer(
                    self._tokenizer, [], [])
            text = "".join([detok.append(t) for t in completion.token_ids if t not in no_text])
            if completion.finish_reason not in (None, "abort"):
                text += detok.flush()
            completion.text = text
