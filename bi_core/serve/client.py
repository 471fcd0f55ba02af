"""The HTTP process's handle on the engine process (``loop.py``): starts it, sends it adds and
aborts, and hands each step's deltas to the requests that asked for them.

Two threads of this process touch the pipe: a sender (so a handler never blocks on a full pipe
while the engine is inside a step) and a receiver (which turns one ``Out`` message into one
hand-over per consumer, e.g. one ``call_soon_threadsafe`` per asyncio loop per step). The
messages are the classes of ``messages.py``. Control calls (``control``) resolve a future once the
engine answered, so a long one (a weight sync) holds no thread of this process."""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

import attrs

from bi_core.errors import BiEngineError, PromptTooLongError, RequestError
from bi_core.rl.coverage import WeightsMissing
from bi_core.runtime.sequence import RequestOutput
from bi_core.serve.loop import engine_main
from bi_core.serve.messages import (
    Abort,
    Add,
    Added,
    ControlDone,
    ControlFailed,
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
from bi_core.serve.metrics import Metrics

log = logging.getLogger(__name__)


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


class Unavailable(BiEngineError):
    """The engine takes no new requests (shutting down, or failed)."""


class Overloaded(Unavailable):
    """Too many requests wait for admission: worth retrying soon."""


class ControlError(BiEngineError):
    """A control call failed; ``reason`` is messages.ControlFailure (invalid, unavailable, error)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@attrs.define(eq=False)
class _Stream:
    emit: Callable[[int, Delta], None]  # (choice index, delta)
    post: Callable | None  # runs ``fn(items)`` on the consumer's thread; None: on the receiver thread
    unfinished: set[int] = attrs.Factory(set)  # choice indices (known once the engine accepted the request)


def _deliver(items: list[tuple[Callable, int, Delta]]) -> None:
    for emit, sample, delta in items:
        emit(sample, delta)


@attrs.frozen
class AddedRequest:
    """What a submission resolves to: its choices' request ids, and the weights they started with."""

    request_ids: list[int]
    weight_version: int


def exit_reason(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code is None:
        return "ended (its exit code is not known yet)"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name} ({-code})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _settle(fut: Future, value: object = None, exception: BaseException | None = None) -> None:
    """Resolve ``fut`` unless its caller cancelled it (stopped waiting)."""
    try:
        fut.set_exception(exception) if exception is not None else fut.set_result(value)
    except InvalidStateError:
        pass


class EngineClient:
    def __init__(self, config, metrics: Metrics) -> None:
        self.metrics = metrics
        self.failure: str | None = None
        self.stopping = False
        self.on_lost: Callable[[str], None] | None = None  # called (receiver thread) if the engine process dies
        self.lost = False  # it did
        self.status: dict = {}  # the engine's last reported status (messages.Out.status: what /health says)
        self._keys = itertools.count()
        self._futures: dict[int, Future] = {}
        self._streams: dict[int, _Stream] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main, args=(config, child), name="bi-engine-core")
        self.proc.start()
        child.close()
        try:
            self.info: EngineInfo = self._wait_ready()
        except BaseException:
            self.proc.kill()  # it ignores SIGTERM/SIGINT (the server stops it through the pipe)
            self.proc.join()
            raise
        threading.Thread(target=self._send_loop, name="bi-engine-send", daemon=True).start()
        threading.Thread(target=self._receive_loop, name="bi-engine-receive", daemon=True).start()

    def _wait_ready(self) -> EngineInfo:
        while True:
            if self.conn.poll(0.2):
                try:
                    msg = self.conn.recv()
                except EOFError:  # the process ended without a word (killed, crashed): reported below
                    self.proc.join()
                else:
                    match msg:
                        case Ready(info):
                            return info
                        case StartFailed(message):
                            raise BiEngineError(message)
                        case _:
                            raise UnexpectedMessage(msg, "the HTTP process (starting the engine)", (Ready, StartFailed))
            if not self.proc.is_alive():
                raise BiEngineError(f"the engine process exited with code {self.proc.exitcode} while starting "
                                    "(see the log above)")

    # ------------------------------------------------------------------ called from the HTTP side

    @property
    def accepting(self) -> bool:
        return not self.stopping and self.failure is None

    def submit(self, jobs: list[tuple], emit: Callable[[int, Delta], None], post: Callable | None = None) -> Future:
        """Queue a request of one or more ``(prompt, params)`` jobs, all in one message (the engine
        adds them before its next step, all or none). Its choices are the jobs' samples in order
        (job j's sample i is choice ``j * params.n + i``). The future resolves to the choices'
        request ids and weight version (``AddedRequest``), or to an error (RequestError /
        PromptTooLongError: a bad request;
        Overloaded / Unavailable: try later) so the caller can answer before streaming anything.
        ``emit(choice, delta)`` reports each choice's progress: on the receiver thread, or through
        ``post`` (e.g. an asyncio loop's ``call_soon_threadsafe``) on the consumer's, one hand-over
        per consumer per engine step."""
        fut: Future = Future()
        if not self.accepting:
            fut.set_exception(Unavailable(self.failure or "the server is shutting down"))
            return fut
        key = next(self._keys)
        self._futures[key], self._streams[key] = fut, _Stream(emit, post)
        self._outbox.put(Add(key, jobs))
        return fut

    def control(self, kind: type, **fields) -> Future:
        """Send a control call (a class of ``messages.CONTROL``, its fields but ``key``); the future
        resolves to its value once the engine did it, or to ControlError / Unavailable."""
        fut: Future = Future()
        if not self.accepting:
            fut.set_exception(Unavailable(self.failure or "the server is shutting down"))
            return fut
        key = next(self._keys)
        self._futures[key] = fut
        self._outbox.put(kind(key, **fields))
        return fut

    def abort(self, request_ids: list[int]) -> None:
        """Abort these requests, all before the engine's next step."""
        if request_ids:
            self._outbox.put(Abort(request_ids))

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests; the engine aborts those still unfinished ``timeout_s`` from now
        (their last delta carries the reason) and then ends. Safe in a signal handler."""
        self.stopping = True
        self._outbox.put(Stop(timeout_s))

    def stop(self, timeout_s: float) -> None:
        """Refuse new requests, let the running ones finish within ``timeout_s``, abort the rest,
        and wait for the engine process to end."""
        if self.proc.is_alive():
            self.drain(timeout_s)
            self._stopped.wait(timeout_s + 120)
        self.stopping = True
        self._outbox.put(None)
        self.proc.join(60)
        if self.proc.is_alive():
            log.warning("the engine process did not stop; killing it")
            self.proc.kill()
            self.proc.join()

    # ------------------------------------------------------------------ the pipe's threads

    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (BrokenPipeError, OSError):
                return  # the engine process is gone: the receiver reports it

    def _receive_loop(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return self._lost()
            try:
                if self._dispatch(msg):
                    return
            except UnexpectedMessage as e:  # a bug: fail what waits on the engine, take no more requests
                log.error("%s", e)
                self.failure = self.failure or "internal error: an unexpected message from the engine process (see the log)"
                return self._lost()

    def _dispatch(self, msg: Added | Refused | ControlDone | ControlFailed | Out | Stopped) -> bool:
        """One message from the engine process (after Ready); True once it said it stopped. Any
        other type raises UnexpectedMessage."""
        match msg:
            case Out(deltas, counts, failure, status):
                if failure is not None:
                    self.failure = failure
                if status is not None:
                    self.status = status
                self._hand_over(deltas)
                self.metrics.apply(counts)
            case Added(key, request_ids, weight_version):
                self._streams[key].unfinished = set(range(len(request_ids)))
                try:
                    self._futures.pop(key).set_result(AddedRequest(request_ids, weight_version))
                except InvalidStateError:  # its caller stopped waiting (e.g. a timeout while it was held)
                    self.abort(request_ids)
            case Refused(key, reason, message):
                self._streams.pop(key, None)
                error = {"prompt_too_long": PromptTooLongError, "invalid": RequestError, "overloaded": Overloaded,
                         "no_weights": WeightsMissing}.get(reason, Unavailable)
                _settle(self._futures.pop(key), exception=error(message))
            case ControlDone(key, value):
                _settle(self._futures.pop(key), value)
            case ControlFailed(key, reason, message):
                _settle(self._futures.pop(key), exception=ControlError(reason, message))
            case Stopped():  # an add sent after the engine's loop ended gets no answer: refuse it here
                for key in list(self._futures):
                    self._streams.pop(key, None)
                    _settle(self._futures.pop(key), exception=Unavailable("the server is shutting down"))
                self._stopped.set()
                return True
            case _:
                raise UnexpectedMessage(msg, "the HTTP process", (Added, Refused, ControlDone, ControlFailed, Out,
                                                                  Stopped))
        return False

    def _hand_over(self, deltas: list[WireDelta]) -> None:
        batches: dict[Callable | None, list] = {}
        for key, choice, *fields in deltas:
            stream = self._streams.get(key)
            if stream is None:  # cannot happen unless the engine emits after a stream's last delta
                log.error("engine output for an unknown stream %d dropped", key)
                continue
            delta = Delta(*fields)
            if delta.finished:
                stream.unfinished.discard(choice)
                if not stream.unfinished:
                    del self._streams[key]
            batches.setdefault(stream.post, []).append((stream.emit, choice, delta))
        for post, items in batches.items():
            _deliver(items) if post is None else post(_deliver, items)

    def _lost(self) -> None:
        """The engine process ended without being asked: say how (its exit code or signal), fail
        what is waiting on it, and tell ``on_lost`` (the server exits, non-zero)."""
        if self._stopped.is_set():
            return
        self.lost = True
        self.proc.join(5)  # reaped, so that its exit code is known
        self.failure = self.failure or f"the engine process {exit_reason(self.proc.exitcode)}"
        log.error("%s; the server stops (a supervisor may restart it)", self.failure)
        for key, fut in list(self._futures.items()):
            self._futures.pop(key, None)
            _settle(fut, exception=Unavailable(self.failure))
        out = RequestOutput(request_id=-1, prompt_token_ids=[], token_ids=[], text=None, token_logprobs=[],
                            logprobs=None, finish_reason="error", error=self.failure)
        for key, stream in list(self._streams.items()):
            self._streams.pop(key, None)
            items = [(stream.emit, i, Delta([], [], [], "", out)) for i in sorted(stream.unfinished)]
            _deliver(items) if stream.post is None else stream.post(_deliver, items)
        self._stopped.set()
        if self.on_lost is not None:
            self.on_lost(self.failure)
