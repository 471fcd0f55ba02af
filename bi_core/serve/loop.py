"""The engine process of ``bi-engine serve``: one loop owns the LLMEngine and steps it; the HTTP
process (``client.py``) talks to it over a pipe.

Why a process of its own: an HTTP front formatting hundreds of streams (JSON, SSE, logprob dicts)
holds the GIL, and an engine thread sharing that GIL waits for it at every torch call that
releases and re-takes it; with one process, HTTP cost a growing share of the Python API's time as
streams were added (docs/benchmarks.md section 7; section 7b measures this design). Here the
engine's process runs nothing but the loop, on the main thread that built the engine (torch's CPU
thread pool belongs to it). The pipe carries token ids, logprobs and the engine's incremental
text: one message per step with every stream's delta, polled between steps (no thread in this
process).

The messages are the classes of ``messages.py`` (each says who sends it and when): ``Add``,
``Abort`` and ``Stop`` come in; ``Ready`` or ``StartFailed`` once at start, ``Added`` or
``Refused`` per add, ``Out`` per loop iteration that produced anything and ``Stopped`` go out.

A request's prompts join the running batch together at the next step (continuous batching as in
``generate``); an abort frees the requests' KV pages and state slots before the next step. After
``Stop``, what is still unfinished at the deadline is aborted, each with a last delta saying why."""

from __future__ import annotations

import logging
import signal
import time

import attrs

from bi_core.errors import BiEngineError, PromptTooLongError
from bi_core.runtime.engine import LLMEngine
from bi_core.runtime.sequence import SamplingParams, Sequence, Status
from bi_core.serve.messages import (
    TO_ENGINE,
    Abort,
    Add,
    Added,
    EngineInfo,
    Out,
    Ready,
    Refused,
    StartFailed,
    Stop,
    Stopped,
    UnexpectedMessage,
    WireDelta,
)
from bi_core.serve.metrics import StepCounter
from bi_core.serve.threads import size_engine_threads

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05


@attrs.define(eq=False)
class _Tracked:
    seq: Sequence
    key: int  # the HTTP side's id of the submission
    choice: int  # which of the submission's choices (its prompts' samples, in order)
    tokens_sent: int = 0
    text_sent: int = 0


class EngineLoop:
    """Steps the engine; commands (``messages.py``) come from ``channel`` (``poll``/``recv``/``send``,
    a multiprocessing Connection), outputs go back on it."""

    def __init__(self, engine: LLMEngine, channel, *, max_waiting: int) -> None:
        self.engine, self.channel, self.max_waiting = engine, channel, max_waiting
        self.tracked: dict[int, _Tracked] = {}
        self.counter = StepCounter()
        self.stopping = False
        self.deadline = 0.0
        self.shutdown_timeout_s = 0.0
        self.failure: str | None = None  # set when a step raised: the engine may be unusable
        self._out: list[WireDelta] = []

    def run(self) -> None:
        while True:
            busy = self.engine.scheduler.has_work() and self.failure is None
            self._drain(0.0 if busy else IDLE_WAIT_S)
            if self.stopping and (not self.tracked or time.monotonic() >= self.deadline):
                self._abort_at_shutdown()
                self._flush()
                return
            if self.engine.scheduler.has_work() and self.failure is None:
                self._step()
            self._flush()

    def _drain(self, wait_s: float) -> None:
        try:
            if not self.channel.poll(wait_s):
                return
            while self.channel.poll(0):
                self._command(self.channel.recv())
        except (EOFError, OSError):  # the HTTP process is gone: abort everything and end
            self.stopping, self.deadline = True, 0.0

    def _command(self, msg: Add | Abort | Stop) -> None:
        """One message from the HTTP process; any other type raises UnexpectedMessage (a bug: the
        engine process ends, and the HTTP side fails what was waiting on it)."""
        match msg:
            case Add(key, jobs):
                self._add(key, jobs)
            case Abort(request_ids):
                for rid in request_ids:
                    self._abort(rid)
            case Stop(timeout_s):
                deadline = time.monotonic() + timeout_s
                if not self.stopping or deadline < self.deadline:
                    self.deadline, self.shutdown_timeout_s = deadline, timeout_s
                self.stopping = True
            case _:
                raise UnexpectedMessage(msg, "the engine process", TO_ENGINE)

    def _add(self, key: int, jobs: list[tuple[list[int], SamplingParams]]) -> None:
        """All of a request's prompts, or none of them."""
        if self.stopping or self.failure is not None:
            return self.channel.send(Refused(key, "unavailable", self.failure or "the server is shutting down"))
        if len(self.engine.scheduler.waiting) >= self.max_waiting:
            return self.channel.send(Refused(key, "overloaded",
                                             f"too many waiting requests ({self.max_waiting}); retry later"))
        seqs: list[Sequence] = []
        try:
            for prompt, params in jobs:
                seqs.append(self.engine.add_request(prompt, params, text=True))
        except BiEngineError as e:
            for seq in seqs:  # not one step has run: the request leaves no trace
                self.engine.abort(seq.request_id)
            reason = "prompt_too_long" if isinstance(e, PromptTooLongError) else "invalid"
            where = f"prompt {len(seqs)}: " if len(jobs) > 1 else ""
            return self.channel.send(Refused(key, reason, f"{where}{e}"))
        ids = []
        for seq in seqs:
            for member in seq.group:  # the prompt's n samples, each its own choice
                self.tracked[member.request_id] = _Tracked(member, key, len(ids))
                ids.append(member.request_id)
            self.counter.counts.prompt_tokens += len(seq.prompt_ids)
        self.channel.send(Added(key, ids))

    def _abort(self, request_id: int, error: str | None = None) -> None:
        t = self.tracked.pop(request_id, None)
        if t is None:
            return
        # a sample not yet forked was aborted with its leader: it still gets its last delta
        if self.engine.abort(request_id) or t.seq.finish_reason == "abort":
            self.counter.finished("abort")
            out = self.engine.output_of(t.seq)
            self._out.append((t.key, t.choice, [], [], [], "", attrs.evolve(out, error=error) if error else out))

    def _abort_at_shutdown(self) -> None:
        if not self.tracked:
            return
        why = f"the server shut down before this request finished (serve.shutdown_timeout_s={self.shutdown_timeout_s:g})"
        log.warning("shutting down: %d unfinished request(s) aborted after serve.shutdown_timeout_s=%g s",
                    len(self.tracked), self.shutdown_timeout_s)
        for rid in list(self.tracked):
            self._abort(rid, why)

    def _step(self) -> None:
        before = sum(len(t.seq.output_ids) for t in self.tracked.values())
        t0 = time.perf_counter()
        try:
            self.engine.step()
        except Exception as e:  # noqa: BLE001 - report to every waiting client, keep serving /health
            log.exception("engine step failed")
            self.failure = f"engine step failed: {e}"
            for rid, t in list(self.tracked.items()):
                t.seq.finish("error", self.failure)
                self._emit(rid, t)
            return
        dt = time.perf_counter() - t0
        generated = sum(len(t.seq.output_ids) for t in self.tracked.values()) - before
        for rid, t in list(self.tracked.items()):
            self._emit(rid, t)
        self.counter.step(dt, generated)

    def _emit(self, rid: int, t: _Tracked) -> None:
        seq, new = t.seq, len(t.seq.output_ids)
        done = seq.status is Status.FINISHED
        if new == t.tokens_sent and not done:
            return
        text = seq.text.text if seq.text is not None else ""
        upto = len(text) if done or seq.text is None else seq.text.settled  # a stop string may still cut the rest
        self._out.append((t.key, t.choice, seq.output_ids[t.tokens_sent:new],
                          seq.token_logprobs[t.tokens_sent:new],
                          seq.top_logprobs[t.tokens_sent:new] if seq.params.logprobs is not None else [],
                          text[t.text_sent:upto], self.engine.output_of(seq) if done else None))
        t.tokens_sent, t.text_sent = new, max(t.text_sent, upto)
        if done:
            del self.tracked[rid]
            self.counter.finished(seq.finish_reason or "unknown")

    def _flush(self) -> None:
        """This iteration's deltas and counts (and the engine's state, if it changed) in one message."""
        counts = self.counter.take(self.engine)
        if self._out or counts:
            out, self._out = self._out, []
            self.channel.send(Out(out, counts, self.failure))


def engine_main(config, channel) -> None:
    """The engine process: build the engine, say ready (or why not), run the loop until stopped."""
    # Ctrl-C in a terminal and a process manager's SIGTERM to the whole group reach this process
    # too: the HTTP process decides how to stop (finish in-flight requests first) and tells us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s:  [engine] %(message)s")
    logging.getLogger("bi_core.serve").setLevel(logging.INFO)
    from bi_core import build_engine

    try:
        size_engine_threads(config)
        engine = build_engine(config)
    except BiEngineError as e:
        channel.send(StartFailed(str(e)))
        return
    except Exception as e:  # a bug: its traceback goes to the log, its message to the HTTP process
        log.exception("building the engine failed")
        channel.send(StartFailed(f"building the engine failed: {type(e).__name__}: {e}"))
        return
    try:
        channel.send(Ready(EngineInfo(engine.max_model_len, engine.policy.batch_invariant, engine.args.vocab_size,
                                      config.scheduler.max_num_seqs)))
        EngineLoop(engine, channel, max_waiting=config.serve.max_waiting_requests).run()
    finally:
        engine.close()
    try:
        channel.send(Stopped())
    except (BrokenPipeError, OSError):
        pass
