"""The engine loop: one thread owns the LLMEngine and runs its steps; the HTTP side talks to it
through a command queue (add, abort) and gets each request's progress back as deltas.

``bi-engine serve`` runs the loop on the main thread (``run``), the thread that built the engine,
and uvicorn on another: torch's CPU thread pool (OpenMP) belongs to the thread that first used
it, and steps run from a second thread were measured 1.4-2.5x slower on a 2-core CPU (two pools
contending); CUDA's current stream is per thread too. ``start`` runs it on its own thread instead,
for embedding the app elsewhere.

Requests join the running batch at the next step (continuous batching as in ``generate``); an
abort frees the request's KV pages and state slot before the next step. The engine stays
synchronous and knows nothing of HTTP; nothing but this thread touches it."""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import attrs

from bi_core.errors import BiEngineError
from bi_core.runtime.engine import LLMEngine, Prompt
from bi_core.runtime.sequence import RequestOutput, SamplingParams, Sequence, Status
from bi_core.serve.metrics import Metrics

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05


@attrs.frozen
class Delta:
    """A request's progress since its previous delta."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]  # empty unless the request asked for logprobs
    text: str
    output: RequestOutput | None = None  # set on the last delta (the request finished)

    @property
    def finished(self) -> bool:
        return self.output is not None


@attrs.define(eq=False)
class _Tracked:
    seq: Sequence
    emit: Callable[[Delta], None]
    post: Callable | None = None  # runs ``fn(*args)`` on the consumer's thread (e.g. call_soon_threadsafe)
    tokens_sent: int = 0
    text_sent: int = 0


def _deliver(items: list[tuple[Callable[[Delta], None], Delta]]) -> None:
    for emit, delta in items:
        emit(delta)


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: Metrics, *, max_waiting: int) -> None:
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.tracked: dict[int, _Tracked] = {}
        self.stopping = False
        self.deadline: float | None = None
        self.failure: str | None = None  # set when a step raised: the engine may be unusable
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self._outbox: dict[Callable, list] = {}  # deltas of this iteration per consumer, posted at once

    def start(self) -> None:
        """Run the loop on a thread of its own (``run`` runs it on the caller's)."""
        self.thread = threading.Thread(target=self.run, name="bi-engine-loop", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ called from the HTTP side

    def submit(self, prompt: Prompt, params: SamplingParams, emit: Callable[[int, Delta], None],
               post: Callable | None = None) -> Future:
        """Queue a request; the future resolves to the request ids of its ``params.n`` samples, or
        to the engine's RequestError (bad prompt) so the caller can answer 400 before streaming
        anything. ``emit(sample_index, delta)`` reports each sample's progress: called on the
        engine thread, or with ``post`` (e.g. an asyncio loop's ``call_soon_threadsafe``) on the
        consumer's, every request sharing a ``post`` getting one hand-over per engine step."""
        fut: Future = Future()
        self.commands.put(("add", (prompt, params, emit, post, fut)))
        self.wakeup.set()
        return fut

    def abort(self, request_id: int) -> None:
        self.commands.put(("abort", request_id))
        self.wakeup.set()

    def stop(self, timeout_s: float) -> None:
        """Refuse new requests, let the running ones finish within ``timeout_s``, abort the rest,
        and end the thread."""
        self.deadline = time.monotonic() + timeout_s
        self.stopping = True
        self.wakeup.set()
        self.done.wait()

    @property
    def accepting(self) -> bool:
        return not self.stopping and self.failure is None

    # ------------------------------------------------------------------ the engine thread

    def run(self) -> None:
        """Step the engine until ``stop``: the loop body, on whichever thread calls it."""
        try:
            self._loop()
        finally:
            self.done.set()

    def _loop(self) -> None:
        while True:
            self.wakeup.clear()  # before draining: a command queued after this point sets it again
            self._drain()
            if self.stopping and (not self.tracked or time.monotonic() >= self.deadline):
                for rid in list(self.tracked):
                    self._abort(rid)
                self._flush()
                return
            if self.engine.scheduler.has_work() and self.failure is None:
                self._step()
                self._flush()
            else:
                self.wakeup.wait(IDLE_WAIT_S)

    def _drain(self) -> None:
        while True:
            try:
                kind, payload = self.commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(*payload)
            else:
                self._abort(payload)
        self._flush()

    def _add(self, prompt, params, emit, post, fut: Future) -> None:
        if not self.accepting:
            fut.set_exception(BiEngineError(self.failure or "the server is shutting down"))
            return
        if len(self.engine.scheduler.waiting) >= self.max_waiting:
            fut.set_exception(BiEngineError(f"too many waiting requests ({self.max_waiting}); retry later"))
            return
        try:
            seq = self.engine.add_request(prompt, params, text=True)
        except BiEngineError as e:
            fut.set_exception(e)
            return
        for member in seq.group:  # the prompt's n samples, each its own stream
            self.tracked[member.request_id] = _Tracked(member, functools.partial(emit, member.sample_index), post)
        self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
        fut.set_result([member.request_id for member in seq.group])

    def _abort(self, request_id: int) -> None:
        t = self.tracked.pop(request_id, None)
        if t is None:
            return
        # a sample not yet forked was aborted with its leader: it still gets its last delta
        if self.engine.abort(request_id) or t.seq.finish_reason == "abort":
            self.metrics.finished.labels("abort").inc()
            self._send(t, Delta([], [], [], "", self.engine.output_of(t.seq)))

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
        self._recent.append((dt, generated))
        for rid, t in list(self.tracked.items()):
            self._emit(rid, t)
        self.metrics.observe_step(self.engine, dt, generated, self._recent)

    def _emit(self, rid: int, t: _Tracked) -> None:
        seq, new = t.seq, len(t.seq.output_ids)
        done = seq.status is Status.FINISHED
        if new == t.tokens_sent and not done:
            return
        text = seq.text.text if seq.text is not None else ""
        upto = len(text) if done or seq.text is None else seq.text.settled  # a stop string may still cut the rest
        delta = Delta(seq.output_ids[t.tokens_sent:new], seq.token_logprobs[t.tokens_sent:new],
                      seq.top_logprobs[t.tokens_sent:new] if seq.params.logprobs is not None else [],
                      text[t.text_sent:upto], self.engine.output_of(seq) if done else None)
        t.tokens_sent, t.text_sent = new, max(t.text_sent, upto)
        if done:
            del self.tracked[rid]
            self.metrics.finished.labels(seq.finish_reason or "unknown").inc()
        self._send(t, delta)

    def _send(self, t: _Tracked, delta: Delta) -> None:
        if t.post is None:
            t.emit(delta)
        else:
            self._outbox.setdefault(t.post, []).append((t.emit, delta))

    def _flush(self) -> None:
        """Hand each consumer this iteration's deltas in one call (one event-loop wake-up per
        step, instead of one per stream)."""
        outbox, self._outbox = self._outbox, {}
        for post, items in outbox.items():
            post(_deliver, items)
