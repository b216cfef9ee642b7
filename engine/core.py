"""The engine process: one ``LLMEngine`` and the loop that drives it while serving.

Started by ``engine.async_engine.AsyncEngine`` as ``python -m engine.core`` (on CPU and GPU
alike), so the model's step loop never shares a GIL with the gateway's event loop. Once the model
is loaded it saves its tokenizer into the client's ``--tokenizer-dir`` (``save_pretrained``), then
sends ``EngineReady``: the client renders prompts with the same tokenizer. Between two
steps it takes every client message that has arrived; after each step it sends one
``StepOutputs`` message with every request's new tokens (see ``engine.ipc``).

It exits when told to (``Shutdown``), and by itself when its parent process is gone (the read
end of a pipe whose write end only the parent holds becomes readable at EOF). SIGINT and
SIGTERM are ignored: a Ctrl-C reaches the whole process group, a supervisor may signal the
whole group (systemd's control-group kill), and the gateway shuts the engine down in order.
"""

import argparse
import gc
import logging
import os
import signal
import sys
import time

import msgspec
import zmq

from engine.config import EngineConfig
from engine.ipc import (
    STATS_INTERVAL_S,
    AbortRequests,
    AddRequest,
    CallAnswer,
    ClientMessage,
    EngineReady,
    EngineStartupFailed,
    LockSession,
    RequestFailed,
    Shutdown,
    StepOutputs,
    UnlockSession,
    UnpinSession,
    engine_decoder,
)
from engine.llm_engine import LLMEngine
from engine.logs import configure_logging
from engine.outputs import RequestOutput
from engine.tensor_parallel import WorkerDied

logger = logging.getLogger("engine.core")


class EngineCore:
    """Runs ``engine`` for clients: client ``i`` sends on ``inboxes[i]`` and is sent to on
    ``outboxes[i]``; ``parent_fd`` turns readable when the parent process exits.

    With several clients (``--api-server-count``), each request's outputs and refusals and each
    call's answer go to the client that sent it; pin changes and stats snapshots go to every
    client; a session's turn lock (``LockSession``) is held by one client at a time."""

    def __init__(self, engine: LLMEngine, inboxes: list[zmq.Socket],
                 outboxes: list[zmq.Socket], parent_fd: int) -> None:
        self.engine = engine
        self.inboxes = inboxes
        self.outboxes = outboxes
        self.parent_fd = parent_fd
        self._decoder = engine_decoder()
        self._encoder = msgspec.msgpack.Encoder()
        self._stopping = False
        self.failed = False  # stopped because the engine cannot step again
        self.orphaned = False  # stopped because the gateway process is gone
        self._pending = StepOutputs()  # outputs of every client, pin changes, stats
        clients = range(len(inboxes))
        self._failed: list[list[RequestFailed]] = [[] for _ in clients]
        self._answers: list[list[CallAnswer]] = [[] for _ in clients]
        self._owner: dict[str, int] = {}  # request id -> its client (several clients only)
        self._locks: dict[str, int] = {}  # session id -> the client holding its turn lock
        self._done: set[int] = set()  # clients that sent Shutdown
        self._stats_at = 0.0
        self._changed = False  # since the last stats snapshot
        self._steps = self._prompt_steps = 0
        self._step_seconds = 0.0

    def run(self) -> None:
        poller = zmq.Poller()
        for inbox in self.inboxes:
            poller.register(inbox, zmq.POLLIN)
        poller.register(self.parent_fd, zmq.POLLIN)
        workers = self.engine.worker_sentinels()  # readable once a worker has exited
        for fd in workers:
            poller.register(fd, zmq.POLLIN)
        while not self._stopping:
            busy = self.engine.has_unfinished()
            events = dict(poller.poll(0 if busy else None))
            if self.parent_fd in events:
                logger.warning("the gateway process is gone; the engine exits")
                self.orphaned = True
                return
            if any(fd in events for fd in workers):
                self._stop_failed("a tensor-parallel worker exited")
                break
            if any(inbox in events for inbox in self.inboxes):
                self._take_messages()
            if self.engine.has_unfinished():
                self._step()
            self._send()
        logger.info("engine stopped")

    def _take_messages(self) -> None:
        """Every message that has arrived, unlocks first: a lock released by one client
        before another asks for it is free, whichever socket is read first."""
        arrived: list[tuple[int, ClientMessage]] = []
        for client, inbox in enumerate(self.inboxes):
            while True:
                try:
                    data = inbox.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                arrived.append((client, self._decoder.decode(data.buffer)))
        arrived.sort(key=lambda item: not isinstance(item[1], UnlockSession))
        for client, message in arrived:
            self._handle(client, message)
        self._changed = True

    def _handle(self, client: int, message: ClientMessage) -> None:
        match message:
            case AddRequest():
                try:
                    self.engine.add_request(message.request_id, message.prompt_token_ids,
                                            message.params, session_id=message.session_id,
                                            cache_salt=message.cache_salt)
                except ValueError as error:
                    self._failed[client].append(
                        RequestFailed(message.request_id, str(error), invalid=True))
                    return
                if len(self.inboxes) > 1:
                    self._owner[message.request_id] = client
            case AbortRequests():
                for request_id in message.request_ids:
                    if self._owner.pop(request_id, client) == client:
                        self.engine.abort(request_id)
            case UnpinSession():
                unpinned = self.engine.unpin_session(message.session_id)
                self._answers[client].append(CallAnswer(message.call_id, unpinned))
            case LockSession():
                free = message.session_id not in self._locks
                if free:
                    self._locks[message.session_id] = client
                self._answers[client].append(CallAnswer(message.call_id, free))
            case UnlockSession():
                held = self._locks.get(message.session_id) == client
                if held:
                    del self._locks[message.session_id]
                self._answers[client].append(CallAnswer(message.call_id, held))
            case Shutdown():
                self._leave(client)

    def _leave(self, client: int) -> None:
        """``client`` is done: its requests are aborted, its locks freed; the engine stops
        once every client is done."""
        self._done.add(client)
        self._stopping = len(self._done) == len(self.inboxes)
        for request_id in [r for r, c in self._owner.items() if c == client]:
            del self._owner[request_id]
            self.engine.abort(request_id)
        for session_id in [s for s, c in self._locks.items() if c == client]:
            del self._locks[session_id]

    def _step(self) -> None:
        """One engine step, counted (steps, those with prompt tokens, seconds: the stats'
        ``engine_*``); at debug level, a log line with its time, its sections (host
        milliseconds, ``engine.step_timing``) and token counts."""
        self._changed = True
        engine = self.engine
        began = time.perf_counter()
        prefill, decode = engine.num_prefill_tokens, engine.num_decode_tokens
        try:
            self._pending.outputs.extend(engine.step())
            seconds = time.perf_counter() - began
            self._steps += 1
            self._prompt_steps += int(engine.num_prefill_tokens > prefill)
            self._step_seconds += seconds
            if engine.step_timings:  # timed at debug level
                sections = " ".join(f"{name} {s * 1e3:.2f}"
                                    for name, s in engine.step_timings.pop().sections.items())
                logger.debug("step %.2f ms (%s): %d prefill + %d decode tokens, %d running, "
                             "%d waiting", seconds * 1e3, sections,
                             engine.num_prefill_tokens - prefill,
                             engine.num_decode_tokens - decode,
                             len(engine.scheduler.running), len(engine.scheduler.waiting))
        except WorkerDied as error:
            self._stop_failed(str(error))
        except Exception as error:
            logger.exception("engine step failed; failing the running requests")
            self._fail_all(f"engine step failed: {error}")

    def _stop_failed(self, reason: str) -> None:
        """The engine cannot step again: fail every request and stop."""
        logger.error("%s; the engine stops", reason)
        self._fail_all(f"engine stopped: {reason}")
        self._send()
        self._stopping = self.failed = True

    def _fail_all(self, reason: str) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            client = self._owner.pop(request_id, 0)
            self._failed[client].append(RequestFailed(request_id, reason, invalid=False))

    def _send(self) -> None:
        """Send what this iteration produced, with a stats snapshot when one is due: while busy
        every ``STATS_INTERVAL_S``, and before going idle after anything changed."""
        pending = self._pending
        pending.pin_changes = self.engine.take_pin_changes()
        now = time.monotonic()
        busy = self.engine.has_unfinished()
        if self._changed and (not busy or now - self._stats_at >= STATS_INTERVAL_S):
            pending.stats = msgspec.structs.replace(
                self.engine.stats(), engine_steps=self._steps,
                engine_prompt_steps=self._prompt_steps, engine_step_seconds=self._step_seconds)
            self._stats_at = now
            self._changed = False
        if len(self.inboxes) == 1:
            pending.failed, pending.answers = self._failed[0], self._answers[0]
            if (pending.outputs or pending.failed or pending.pin_changes or pending.answers
                    or pending.stats is not None):
                self._deliver(0, pending)
                self._failed[0], self._answers[0] = [], []
        else:
            self._send_each(pending)
        self._pending = StepOutputs()

    def _send_each(self, pending: StepOutputs) -> None:
        """Several clients: each gets its own requests' outputs, refusals and answers, and the
        pin changes and stats snapshot."""
        outputs: list[list[RequestOutput]] = [[] for _ in self.inboxes]
        owner = self._owner
        for output in pending.outputs:
            client = (owner.pop(output.request_id, None) if output.finished
                      else owner.get(output.request_id))
            if client is not None:
                outputs[client].append(output)
        shared = bool(pending.pin_changes) or pending.stats is not None
        for client in range(len(self.inboxes)):
            if client in self._done:
                continue
            if outputs[client] or self._failed[client] or self._answers[client] or shared:
                self._deliver(client, StepOutputs(
                    outputs[client], self._failed[client], pending.pin_changes,
                    self._answers[client], pending.stats))
                self._failed[client], self._answers[client] = [], []

    def _deliver(self, client: int, message: StepOutputs) -> None:
        self.outboxes[client].send(self._encoder.encode(message), copy=False)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.core", description=__doc__)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--inbox", required=True, action="append",
                        help="ZeroMQ address to receive a client's messages from (one per "
                             "client, in the order of --outbox)")
    parser.add_argument("--outbox", required=True, action="append",
                        help="ZeroMQ address to send a client's messages to")
    parser.add_argument("--parent-fd", type=int, required=True,
                        help="read end of a pipe only the parent process writes to")
    parser.add_argument("--tokenizer-dir", required=True,
                        help="folder to save the engine's tokenizer in before EngineReady "
                             "(the client reads it there; nothing is written without one)")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def _close(context: zmq.Context, inboxes: list[zmq.Socket], outboxes: list[zmq.Socket],
           linger: int | None) -> None:
    """Close the sockets (an outbox lingers ``linger`` ms, None: its LINGER option)."""
    for inbox in inboxes:
        inbox.close(linger=0)
    for outbox in outboxes:
        outbox.close(linger=linger)
    context.term()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    configure_logging(args.log_level)
    context = zmq.Context()
    inboxes, outboxes = [], []
    for inbox_address, outbox_address in zip(args.inbox, args.outbox, strict=True):
        inbox = context.socket(zmq.PULL)
        inbox.connect(inbox_address)
        outbox = context.socket(zmq.PUSH)
        outbox.setsockopt(zmq.SNDHWM, 0)  # never block or drop: the client reads every message
        outbox.setsockopt(zmq.LINGER, 10_000)
        outbox.connect(outbox_address)
        inboxes.append(inbox)
        outboxes.append(outbox)
    encoder = msgspec.msgpack.Encoder()
    try:
        config = msgspec.json.decode(args.config, type=EngineConfig)
        engine = LLMEngine(config, track_pin_changes=True,
                           time_steps=logger.isEnabledFor(logging.DEBUG))
        if engine.tokenizer is not None:  # the client's tokenizer: this one, read without torch
            engine.tokenizer.save_pretrained(args.tokenizer_dir)
    except BaseException as error:  # noqa: BLE001 - reported to the client, then exit
        logger.exception("the engine failed to start")
        message = encoder.encode(EngineStartupFailed(f"{type(error).__name__}: {error}"))
        for outbox in outboxes:
            outbox.send(message)
        _close(context, inboxes, outboxes, linger=None)  # lingers until the message is out
        return 1
    engine.start_grammar_worker()  # its imports run while the gateway connects
    # Everything alive now (model, tokenizer, modules) lives as long as the process: keep it
    # out of the collector's full passes, which would otherwise stall steps for 100+ ms.
    gc.collect()
    gc.freeze()
    ready = encoder.encode(EngineReady(engine.info, engine.stats()))
    for outbox in outboxes:
        outbox.send(ready)
    logger.info("engine ready (pid %d, %d client%s)", os.getpid(), len(outboxes),
                "s" if len(outboxes) > 1 else "")
    core = EngineCore(engine, inboxes, outboxes, args.parent_fd)
    core.run()
    engine.shutdown()
    # nobody reads what is still queued once the gateway is gone
    _close(context, inboxes, outboxes, linger=0 if core.orphaned else None)
    return 1 if core.failed else 0


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    # Leave without the interpreter's teardown: the process's memory goes with it, while the
    # teardown would free the frozen objects (a whole model's) one by one, for seconds, and
    # Triton's (torch imports it) would outlive its nanobind extension, which then prints
    # "nanobind: leaked ..." for each.
    os._exit(code)
