"""The engine core: requests in, one scheduled step at a time, outputs out.

With overlapped scheduling (``EngineConfig.async_scheduling``) a step is launched before the
previous one's tokens are read, and its rows are sampled once they are (penalties see every
token); the grammar masks of its rows start filling in the grammar worker process once those
tokens are read, and its draw is queued at once behind a wait for them (on a GPU the device waits,
while the host goes on; see ``engine.grammars``). Each sampled sequence ends in
``PLACEHOLDER`` until the next step resolves it (so the scheduler counts the token it will
compute), the next step's input for it is taken on the device, and a sequence that the
resolved token finishes has computed one token more, discarded. Between steps at most one step
is in flight, and a placeholder is only ever a sequence's last token, never in a hashed block
or a pin. A drafting step (``engine.speculative``) reads the one in flight first; not overlapped.

Not thread-safe: exactly one thread drives it (the caller of ``LLM``, or the loop of the engine
process, ``engine.core``).
"""

import weakref
from collections.abc import Collection

import torch

from engine.chat import render_chat
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.grammars import Grammars
from engine.inflight import PLACEHOLDER, InflightStep
from engine.info import EngineInfo
from engine.kv_cache_manager import KVCacheManager
from engine.kv_transfer import KVTransfer
from engine.loader import LoadedModel
from engine.outputs import RequestOutput, TokenLogprob
from engine.request import Request
from engine.runner_factory import build_runner, load_for_rank
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.speculative import Speculator
from engine.stats import EngineStats, snapshot
from engine.step_sampling import StepSampler
from engine.step_timing import NO_CLOCK, NoClock, StepClock, StepTiming
from engine.structured import GrammarMasks
from engine.tensor_parallel import check_divisible
from engine.tensor_parallel_workers import start_workers
from engine.token_append import append_token, eos_token_ids


class LLMEngine:
    """``track_pin_changes``: record session pins and unpins for :meth:`take_pin_changes` (the
    engine process mirrors them to the gateway, which renders prompts against them).
    ``step_timings``: each step's ``StepTiming`` (``engine.step_timing``), appended while it is
    a list (``time_steps``, or set by whoever measures); None, the default: nothing is timed."""

    def __init__(self, config: EngineConfig, track_pin_changes: bool = False,
                 loaded: LoadedModel | None = None, time_steps: bool = False) -> None:
        """``loaded``: an already loaded ``config.model`` on ``config``'s device and dtype
        (weights shared with something else, e.g. a transformers model in a benchmark);
        by default the engine loads it. ``time_steps``: record ``step_timings``."""
        self.config = config
        torch.manual_seed(config.seed)
        own_weights = loaded is None
        if own_weights:
            loaded = load_for_rank(config)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.hf_config = loaded.config
        tp = None
        if config.tensor_parallel_size > 1:  # loading checked the sizes split (or do it here)
            check_divisible(loaded.config, config.tensor_parallel_size)
            tp = start_workers(config)
            weakref.finalize(self, tp.shutdown)
        self.runner = build_runner(config, tp, loaded, own_weights)
        self.max_model_len = min(self.runner.max_model_len,
                                 self.runner.num_blocks * config.block_size)
        self.vocab_size = self.runner.model.vocab_size
        host_blocks = (KVTransfer.num_slots(self.runner.bytes_per_block,
                                            config.kv_offloading_size)
                       if config.enable_prefix_caching else 0)
        self.kv_transfer = (KVTransfer(self.runner.kv_cache, host_blocks)
                            if host_blocks > 0 else None)
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
            int(config.pin_budget_fraction * self.runner.num_blocks), track_pin_changes,
            host_blocks,
        )
        admission_batch = config.admission_batch or (
            max(1, config.max_num_seqs // 16) if self.runner.graph_sizes else 1)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   admission_batch)
        self.eos_token_ids = eos_token_ids(self.hf_config, self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.runner.device)
        self.info = EngineInfo(
            model_name=self.model_name, max_model_len=self.max_model_len,
            vocab_size=self.vocab_size, has_tokenizer=self.tokenizer is not None,
            block_size=config.block_size, num_blocks=self.runner.num_blocks,
            generation_defaults=loaded.generation_defaults,
            eos_token_ids=frozenset(self.eos_token_ids),
        )
        self.requests: dict[str, Request] = {}
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda" and tp is None)
        self._inflight: InflightStep | None = None
        self.step_timings: list[StepTiming] | None = [] if time_steps else None
        self.speculator = Speculator.of(config.speculative_config, self.max_model_len)
        # overlapped steps draw through CUDA graphs where they can
        self.sampler = StepSampler(self.eos_token_ids, {
            size: logits for size, (_, logits) in self.runner.graphs.items()
        } if self.async_scheduling else None)

    # -- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request. Each step that gives it tokens (or finishes it) returns a delta
        output for it; with ``final_only`` only the step that finishes it returns an output,
        holding every token and the whole text (see ``engine.outputs``). An invalid request
        raises ``ValueError`` (``EngineInfo.validate``, the check the gateway runs) before
        anything is queued."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.info.validate(prompt_token_ids, params)
        seqs = []
        for index in range(params.n):
            seed = params.seed + index if params.seed is not None else None
            seqs.append(Sequence(request_id, index, prompt_token_ids, params, seed,
                                 session_id=session_id if index == 0 else None,
                                 cache_salt=cache_salt))
            if params.structured is not None:
                self.grammars.attach(seqs[-1], params.structured)
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
            if self.tokenizer is not None and params.detokenize else None
            for _ in seqs
        ]
        self.requests[request_id] = Request(request_id, prompt, list(prompt_token_ids), seqs,
                                             detokenizers, seqs[1:], final_only)
        self.scheduler.add(seqs[0])

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every sample of the request with reason "abort" and forget the request; its
        blocks are released (or pinned to its session) at once. Returns its last output."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                if seq.token_ids[-1] == PLACEHOLDER:  # in flight: never reported
                    seq.token_ids.pop()
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        if request.final_only:
            return request.final_output()
        return request.delta_output(finished=True)

    def unpin_session(self, session_id: str) -> bool:
        return self.kv.unpin(session_id)

    def worker_sentinels(self) -> list[int]:
        """File descriptors that turn readable when a tensor-parallel worker exits (none
        without tensor parallelism)."""
        tp = self.runner.tp
        return [proc.sentinel for proc in tp.workers] if tp is not None else []

    def start_grammar_worker(self) -> None:
        """Start the grammar worker now, not with the first structured request, whose steps
        would wait for its start (seconds) with every request in them; the engine process does
        this (see ``Grammars.start``)."""
        self.grammars.start()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the grammar worker, if any (also done when the
        engine is collected or the interpreter exits); the engine takes no step after it."""
        if self.runner.tp is not None:
            self.runner.tp.shutdown()
        self.grammars.close()

    def take_pin_changes(self) -> dict[str, list[int] | None]:
        """Sessions pinned (their token ids) or unpinned (None) since the last call; empty
        unless the engine was made with ``track_pin_changes``."""
        return self.kv.take_pin_changes()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # -- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, and return an output for every request that
        produced tokens (unless it is ``final_only``) or finished; with overlapped scheduling,
        the outputs are those of the step before (see the module docstring). Timed into
        ``step_timings`` while that is a list."""
        if self.step_timings is None:
            return self._step(NO_CLOCK)
        clock = StepClock(self.runner.device)
        computed = self.num_prefill_tokens + self.num_decode_tokens
        outputs = self._step(clock)
        self.step_timings.append(
            clock.stop(self.num_prefill_tokens + self.num_decode_tokens - computed))
        return outputs

    def _step(self, clock: StepClock | NoClock) -> list[RequestOutput]:
        if self.kv_transfer is not None:
            self.kv.complete_offloads(self.kv_transfer.poll())
        outputs: list[RequestOutput] = []
        if self.speculator is not None and self.speculator.active(self.scheduler.running,
                                                                   self._inflight is not None):
            if self._inflight is not None:  # drafts follow the last token: read it first
                outputs = self._resolve_inflight(clock)
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if self.kv_transfer is not None:  # host tier copies, ahead of the forward
            self.kv_transfer.run(batch.offloads, batch.reloads)
        sample_indices = self._sample_indices(batch)
        sampled = [batch.seqs[i] for i in sample_indices]
        overlap = (self.async_scheduling and bool(batch.seqs)
                   and all(self._overlappable(seq) for seq in sampled))
        clock.lap("schedule")
        if not overlap and self._inflight is not None:
            outputs += self._resolve_inflight(clock)
            batch = self._without_finished(batch)
            sample_indices = self._sample_indices(batch)
        if not batch.seqs:
            return outputs + self._resolve_inflight(clock)
        feed = self._inflight.feed(batch.seqs) if self._inflight is not None else None
        metadata = self.runner.host_metadata(batch)
        clock.note_batch(metadata)
        clock.lap("prepare")
        logits = self.runner.execute(batch, sample_indices, feed, metadata, clock)
        clock.lap("forward")
        if overlap:  # the previous step's tokens are read while this one runs
            resolved = self._read_inflight()
            clock.lap("read")
            # the masks fill in the grammar worker while the resolved tokens are appended
            masks = self.grammars.prepare(sampled, self.runner.last_graph_size or 0)
            clock.lap("grammar")
            outputs += self._apply_tokens(resolved)  # after any a drafting look read
            clock.lap("outputs")
            self._launch_draw(sampled, logits, masks)
            self._commit(batch)
            clock.lap("draw")
            return outputs
        self._commit(batch)
        tokens, verified = self._sample_now(batch, sample_indices, logits)
        clock.lap("sample")
        outputs += self._apply_tokens(tokens, verified)
        clock.lap("outputs")
        return outputs

    @staticmethod
    def _sample_indices(batch: ScheduledBatch) -> list[int]:
        """Rows whose step ends at their last token (or draft): those sample."""
        return [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens,
                                                   strict=True))
                if seq.num_computed_tokens + n == seq.num_tokens + len(seq.draft_token_ids)]

    def _overlappable(self, seq: Sequence) -> bool:
        """Whether ``seq``'s next token can be sampled without reading it at once (logprobs,
        the first token of n > 1, which forks, and drafts' verdicts need it on the host)."""
        return (seq.params.logprobs is None and not seq.draft_token_ids
                and not self.requests[seq.request_id].pending_forks)

    def _launch_draw(self, sampled: list[Sequence], logits: torch.Tensor,
                     masks: GrammarMasks | None) -> None:
        """Draw ``sampled``'s tokens without waiting for them (they become the in-flight step),
        under grammar ``masks`` (being filled) if any. A row a resolved token finished is drawn
        as it is (its token is discarded)."""
        if all(seq.is_finished for seq in sampled):  # nothing to draw
            return
        tokens = self.sampler.draw(sampled, logits, masks, self.runner.last_graph_size)
        # only once drawn: a draw that raised leaves none in flight
        self._inflight = InflightStep.launch(sampled, masks,
                                             *self.runner.keep_sampled(tokens))

    @staticmethod
    def _without_finished(batch: ScheduledBatch) -> ScheduledBatch:
        """``batch`` less the sequences a resolved token finished after it was scheduled
        (their blocks are already freed or pinned)."""
        keep = [i for i, seq in enumerate(batch.seqs) if not seq.is_finished]
        return ScheduledBatch([batch.seqs[i] for i in keep],
                              [batch.num_new_tokens[i] for i in keep], batch.copies)

    def _resolve_inflight(self, clock: StepClock | NoClock) -> list[RequestOutput]:
        """Read the in-flight step's tokens into their sequences (stop checks, text) and
        return the outputs they make."""
        resolved = self._read_inflight()
        clock.lap("read")
        outputs = self._apply_tokens(resolved)
        clock.lap("outputs")
        return outputs

    def _read_inflight(self) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Wait for the in-flight step's tokens and advance the grammars by them (a failed
        mask job they were drawn under raises here)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        tokens = inflight.tokens()
        self.grammars.advance(inflight.masks, tokens)
        return [(seq, token, None) for seq, token in tokens]

    def _commit(self, batch: ScheduledBatch) -> None:
        """Record the KV the step computed, for the sequences still running."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.is_finished:
                continue
            if seq.draft_token_ids or (n == 1 and seq.num_output_tokens > 0):
                self.num_decode_tokens += n
            else:
                self.num_prefill_tokens += n
            if not seq.draft_token_ids:  # a verified one commits per token (_apply_tokens)
                self.kv.commit(seq, n)

    def _sample_now(self, batch: ScheduledBatch, sample_indices: list[int],
                    logits: torch.Tensor
                    ) -> tuple[list[tuple[Sequence, int, TokenLogprob | None]], set[int]]:
        """Sample on the host's watch (grammars, penalties, logprobs, forks, drafts): the
        tokens, read (a speculative sequence's accepted ones), the grammars advanced by them,
        and the seq ids of the speculative sequences."""
        rows: list[int] = []
        sampled: list[Sequence] = []
        ahead: list[int] = []
        row = -1  # the logits row of the last token (of a draft, then the last token)
        for index in sample_indices:
            seq = batch.seqs[index]
            width = 1 + len(seq.draft_token_ids)
            rows += range(row + 1, row + 1 + width)
            row += width
            sampled += [seq] * width
            ahead += range(width)
            request = self.requests[seq.request_id]
            if request.pending_forks and seq is request.seqs[0]:
                for child in request.pending_forks:
                    self.kv.fork(seq, child)
                    self.scheduler.add_running(child)
                    rows.append(row)
                    sampled.append(child)
                    ahead.append(0)
                request.pending_forks = []
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        masks = self.grammars.prepare(sampled, self.runner.last_graph_size or 0)
        token_ids, logprobs = self.sampler.sample(sampled, logits, masks, ahead)
        self.grammars.advance(masks, list(zip(sampled, token_ids, strict=True)))
        tokens = list(zip(sampled, token_ids, logprobs, strict=True))
        if self.speculator is None:
            return tokens, set()
        return self.speculator.settle(tokens)

    def _apply_tokens(self, tokens: list[tuple[Sequence, int, TokenLogprob | None]],
                      verified: Collection[int] = ()) -> list[RequestOutput]:
        """Append each token to its sequence (stop checks, text; nothing past a stop): the
        outputs of the requests that changed. A ``verified`` (seq id) one commits per token."""
        touched: dict[str, Request] = {}
        for seq, token, logprob in tokens:
            request = self.requests[seq.request_id]
            touched[request.request_id] = request
            if seq.is_finished:  # a verified sequence stopped at an earlier token
                continue
            if seq.seq_id in verified:
                self.kv.commit(seq, 1)
            if append_token(request, seq, token, logprob, self.eos_token_ids,
                            self.max_model_len, self.grammars):
                self.scheduler.finish(seq)
        for seq, _, _ in tokens:
            if seq.seq_id in verified and not seq.is_finished:
                self.kv.trim(seq)
        outputs = []
        for request in touched.values():
            finished = request.finished
            if finished:
                del self.requests[request.request_id]
            if request.final_only:
                if finished:
                    outputs.append(request.final_output())
            else:
                outputs.append(request.delta_output(finished))
        return outputs

    # -- chat --------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict], session_id: str | None = None) -> list[int]:
        """Chat template + generation prompt as token ids, continuing the tokens pinned under
        ``session_id`` where they still fit (see ``engine.chat.render_chat``)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        pinned = self.kv.pinned(session_id) if session_id is not None else None
        return render_chat(self.tokenizer, messages,
                           pinned.token_ids if pinned is not None else None)

    def stats(self) -> EngineStats:
        return snapshot(self)
