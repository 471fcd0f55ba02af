"""The engine process of ``bi-engine serve``: one loop owns the LLMEngine and steps it; the HTTP
process (``client.py``) talks to it over a pipe.

Why a process of its own: an HTTP front formatting hundreds of streams (JSON, SSE, logprob dicts)
holds the GIL, and an engine thread sharing that GIL waits for it at every torch call that
releases and re-takes it; with one process, HTTP cost a growing share of the Python API's time as
streams were added (dev/benchmarks-history.md measures both designs). Here the
engine's process runs nothing but the loop, on the main thread that built the engine (torch's CPU
thread pool belongs to it). The pipe carries token ids, logprobs and the engine's incremental
text: one message per step with every stream's delta, polled between steps (no thread in this
process).

The messages are the classes of ``messages.py`` (each says who sends it and when): ``Add``,
``Abort`` and ``Stop`` come in; ``Ready`` or ``StartFailed`` once at start, ``Added`` or
``Refused`` per add, ``Out`` per loop iteration that produced anything and ``Stopped`` go out.

A request's prompts join the running batch together at the next step (continuous batching as in
``generate``); an abort frees the requests' KV pages and state slots before the next step. After
``Stop``, what is still unfinished at the deadline is aborted, each with a last delta saying why.

Control calls (``messages.CONTROL``: pause, resume, sleep, wake, abort, weight sync, ...) run between
steps, in the order they came, and are answered once the engine did them: the deltas of what the call
changed go out first (requests it aborted end with ``finish_reason="abort"``; a pause in mode
``wait`` runs the started requests to their end inside the engine's call, so their last tokens come
together when it returns), then ``ControlDone`` (or ``ControlFailed``). A call that blocks (a weight
sync waits for the trainer's broadcast) blocks this loop: what comes meanwhile waits in the pipe.
Joining a weight-update group does not: its rendezvous runs in a thread (``rl/joining.py``), the
loop steps on, and the call is answered when the rendezvous ends (at most
serve.weight_sync_timeout_s), or at shutdown.
While generation is paused or the engine sleeps, new requests are held here, as vLLM's frontend holds
them: their ``Added`` comes when they are added, at resume or wake-up (so a weight update meanwhile
finds no request in the engine, and they run wholly on the new weights)."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

import attrs

from bi_core.errors import BiEngineError, PromptTooLongError
from bi_core.rl.coverage import WeightsMissing
from bi_core.rl.joining import Join
from bi_core.runtime.engine import LLMEngine
from bi_core.runtime.sequence import SamplingParams, Sequence, Status
from bi_core.runtime.threads import size_engine_threads
from bi_core.serve.loop_control import ControlCalls
from bi_core.serve.messages import (
    TO_ENGINE,
    Abort,
    AbortRequests,
    Add,
    Added,
    CollectiveRpc,
    DestroyWeightsUpdateGroup,
    EngineInfo,
    GetWeightVersion,
    InitWeightsUpdateGroup,
    IsPaused,
    IsSleeping,
    LoadLoraAdapter,
    LoadLoraAdapterFromTensor,
    Out,
    PauseGeneration,
    Ready,
    Refused,
    ResetPrefixCache,
    ResumeGeneration,
    Sleep,
    StartFailed,
    Stop,
    Stopped,
    UnexpectedMessage,
    UnloadLoraAdapter,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    WakeUp,
    WireDelta,
)
from bi_core.serve.metrics import StepCounter

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05


@attrs.define(eq=False)
class _Tracked:
    seq: Sequence
    key: int  # the HTTP side's id of the submission
    choice: int  # which of the submission's choices (its prompts' samples, in order)
    arrival: float  # time.monotonic() when it was added
    tokens_sent: int = 0
    text_sent: int = 0
    last_token: float | None = None  # when its previous delta with tokens went out


class EngineLoop(ControlCalls):
    """Steps the engine; commands (``messages.py``) come from ``channel`` (``poll``/``recv``/``send``,
    a multiprocessing Connection), outputs go back on it."""

    def __init__(self, engine: LLMEngine, channel, *, max_waiting: int, weight_sync_timeout_s: float = 300.0) -> None:
        self.engine, self.channel, self.max_waiting = engine, channel, max_waiting
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.joins: dict[int, Join] = {}  # init calls whose rendezvous runs (by key): answered when it ends
        self._status: dict | None = None  # the engine status last sent (what /health reports)
        self.no_weights = False  # as of the last flush: a level-2 sleep or a broken update left none whole
        self.tracked: dict[int, _Tracked] = {}
        self.counter = StepCounter()
        self.stopping = False
        self.deadline = 0.0
        self.shutdown_timeout_s = 0.0
        self.failure: str | None = None  # set when a step raised: the engine may be unusable
        self._out: list[WireDelta] = []
        # the engine's pause and sleep state, read from it after every call that may change it
        self.paused = self.sleeping = False
        self.resume_on_wake = False  # Sleep paused generation: waking up fully resumes it
        self.held: list[Add] = []  # requests that came while paused or asleep: added when that ends
        self._controls: dict[type, Callable] = {
            PauseGeneration: self._pause, ResumeGeneration: self._resume,
            IsPaused: lambda m: bool(self.engine.is_paused()), AbortRequests: self._abort_requests,
            ResetPrefixCache: lambda m: bool(self.engine.reset_prefix_cache()), Sleep: self._sleep,
            WakeUp: self._wake_up, IsSleeping: lambda m: bool(self.engine.is_sleeping()),
            GetWeightVersion: lambda m: int(self.engine.weight_version),
            InitWeightsUpdateGroup: self._init_weights_update_group,
            UpdateWeightsFromDistributed: self._update_weights_from_distributed,
            DestroyWeightsUpdateGroup: lambda m: self.engine.destroy_weights_update_group(m.group_name),
            UpdateWeightsFromDisk: self._update_weights_from_disk,
            UpdateWeightsFromTensor: self._update_weights_from_tensor, CollectiveRpc: self._collective_rpc,
            LoadLoraAdapter: self._load_lora_adapter, UnloadLoraAdapter: self._unload_lora_adapter,
            LoadLoraAdapterFromTensor: self._load_lora_adapter_from_tensor,
        }

    def run(self) -> None:
        while True:
            self._drain(0.0 if self._can_step() else IDLE_WAIT_S)
            if self.joins:
                self._answer_joins()
            if self.stopping and (not self.tracked or time.monotonic() >= self.deadline):
                self._abort_at_shutdown()
                self._flush()
                return
            if self._can_step():
                self._step()
            self._flush()

    def _can_step(self) -> bool:
        """Step while there is work, unless the engine failed, sleeps, is paused or has no whole
        weights (queued requests then wait for them)."""
        return (self.engine.scheduler.has_work() and self.failure is None and not self.sleeping
                and not self.paused and self.engine.weight_sync.coverage.whole)

    @property
    def holding(self) -> bool:
        """New requests wait here: generation is paused, or the engine sleeps."""
        return self.paused or self.sleeping

    def _drain(self, wait_s: float) -> None:
        try:
            if not self.channel.poll(wait_s):
                return
            while self.channel.poll(0):
                self._command(self.channel.recv())
        except (EOFError, OSError):  # the HTTP process is gone: abort everything and end
            self.stopping, self.deadline = True, 0.0

    def _command(self, msg) -> None:
        """One message from the HTTP process; any other type raises UnexpectedMessage (a bug: the
        engine process ends, and the HTTP side fails what was waiting on it)."""
        match msg:
            case Add(key, jobs):
                if self.holding and not self.stopping and self.failure is None:
                    if len(self.engine.scheduler.waiting) + len(self.held) >= self.max_waiting:
                        return self.channel.send(Refused(key, "overloaded", f"too many waiting requests "
                                                         f"({self.max_waiting}); retry later"))
                    return self.held.append(msg)
                self._add(key, jobs)
            case Abort(request_ids):
                for rid in request_ids:
                    self._abort(rid)
            case Stop(timeout_s):
                deadline = time.monotonic() + timeout_s
                if self.paused or self.sleeping or self.no_weights:
                    deadline = time.monotonic()  # nothing runs until a call that will not come: end now
                if not self.stopping or deadline < self.deadline:
                    self.deadline, self.shutdown_timeout_s = deadline, timeout_s
                self.stopping = True
                self._refuse_held("the server is shutting down")
                self._give_up_joins()
            case _ if type(msg) in self._controls:
                self._control(msg)
            case _:
                raise UnexpectedMessage(msg, "the engine process", TO_ENGINE)

    def _add(self, key: int, jobs: list[tuple[list[int], SamplingParams]]) -> None:
        """All of a request's prompts, or none of them."""
        if self.stopping or self.failure is not None:
            return self.channel.send(Refused(key, "unavailable", self.failure or "the server is shutting down"))
        if self._num_beyond_admission() >= self.max_waiting:
            return self.channel.send(Refused(key, "overloaded",
                                             f"too many waiting requests ({self.max_waiting}); retry later"))
        seqs: list[Sequence] = []
        try:
            for prompt, params, *media in jobs:  # media: {"images", "videos"} decoded on the HTTP side
                seqs.append(self.engine.add_request(prompt, params, text=True, **(media[0] if media else {})))
        except BiEngineError as e:
            for seq in seqs:  # not one step has run: the request leaves no trace
                self.engine.abort(seq.request_id)
            reason = "prompt_too_long" if isinstance(e, PromptTooLongError) else \
                "no_weights" if isinstance(e, WeightsMissing) else "invalid"
            where = f"prompt {len(seqs)}: " if len(jobs) > 1 else ""
            return self.channel.send(Refused(key, reason, f"{where}{e}"))
        ids, now = [], time.monotonic()
        for seq in seqs:
            for member in seq.group:  # the prompt's n samples, each its own choice
                self.tracked[member.request_id] = _Tracked(member, key, len(ids), now)
                ids.append(member.request_id)
            self.counter.counts.prompt_tokens += len(seq.prompt_ids)
        self.channel.send(Added(key, ids, int(self.engine.weight_version)))

    def _num_beyond_admission(self) -> int:
        """Waiting requests beyond the sequence slots the next step has free: the ones that wait,
        which serve.max_waiting_requests bounds. Requests added between two steps all sit in the
        queue until the next one admits them; those it has room for are not waiting for room."""
        sched = self.engine.scheduler
        return len(sched.waiting) - max(sched.config.max_num_seqs - len(sched.running), 0)

    def _refuse_held(self, why: str) -> None:
        for msg in self.held:
            self.channel.send(Refused(msg.key, "unavailable", why))
        self.held.clear()

    def _release_held(self) -> None:
        """Generation runs again: add the requests held meanwhile, in the order they came."""
        if self.holding:
            return
        held, self.held = self.held, []
        for msg in held:
            self._add(msg.key, msg.jobs)

    def _abort(self, request_id: int, error: str | None = None) -> bool:
        t = self.tracked.get(request_id)
        if t is None:
            return False
        # a sample not yet forked was aborted with its leader: it still gets its last delta
        if self.engine.abort(request_id) or t.seq.finish_reason == "abort":
            if error is not None:
                t.seq.error = error
            self._emit(request_id, t, time.monotonic())
            return True
        return False

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
        prompt_before = self.engine.num_prompt_tokens_computed
        t0 = time.perf_counter()
        try:
            self.engine.step()
        except Exception as e:  # noqa: BLE001 - report to every waiting client, keep serving /health
            log.exception("engine step failed")
            self.failure = f"engine step failed: {e}"
            now = time.monotonic()
            for rid, t in list(self.tracked.items()):
                t.seq.finish("error", self.failure)
                self._emit(rid, t, now)
            return
        dt = time.perf_counter() - t0
        generated = sum(len(t.seq.output_ids) for t in self.tracked.values()) - before  # counted as sent (_emit)
        now = time.monotonic()
        for rid, t in list(self.tracked.items()):
            self._emit(rid, t, now)
        self.counter.step(dt, generated, self.engine.num_prompt_tokens_computed - prompt_before)

    def _emit(self, rid: int, t: _Tracked, now: float) -> None:
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
        counts = self.counter.counts
        if new > t.tokens_sent:
            (counts.ttft.append(now - t.arrival) if t.last_token is None else counts.itl.append(now - t.last_token))
            counts.generated += new - t.tokens_sent
            t.last_token = now
        t.tokens_sent, t.text_sent = new, max(t.text_sent, upto)
        if done:
            del self.tracked[rid]
            self.counter.finished(seq.finish_reason or "unknown")
            counts.e2e.append(now - t.arrival)
            counts.request_prompt_tokens.append(len(seq.prompt_ids))
            counts.prefix_queried += len(seq.prompt_ids)
            counts.prefix_hits += seq.num_cached_tokens
            counts.request_generation_tokens.append(new)

    def _flush(self) -> None:
        """This iteration's deltas and counts (and the engine's state, if it changed) in one message."""
        counts = self.counter.take(self.engine, held=len(self.held))
        status = self._engine_status()
        self.no_weights = status["weights_missing"] is not None
        changed = status != self._status
        if self._out or counts or changed:
            out, self._out, self._status = self._out, [], status
            self.channel.send(Out(out, counts, self.failure, status if changed else None))

    def _engine_status(self) -> dict:
        """What /health says of the engine: why it has no whole weights, its weight-update groups."""
        sync = self.engine.weight_sync
        return {"weights_missing": None if sync.coverage.whole else sync.coverage.reason,
                "weight_groups": {name: state["state"] for name, state in sync.states().items()}}


def engine_main(config, channel) -> None:
    """The engine process: build the engine, say ready (or why not), run the loop until stopped."""
    # Ctrl-C in a terminal and a process manager's SIGTERM to the whole group reach this process
    # too: the HTTP process decides how to stop (finish in-flight requests first) and tells us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s:  [engine] %(message)s")
    for name in ("bi_core.serve", "bi_core.runtime.threads"):  # the server's own lines, and its thread sizing
        logging.getLogger(name).setLevel(logging.INFO)
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
                                      config.scheduler.max_num_seqs, config.parallel.tensor_parallel_size,
                                      tuple((x.name, x.source) for x in engine.lora_adapters()),
                                      takes_images=engine.runner.vision is not None)))
        EngineLoop(engine, channel, max_waiting=config.serve.max_waiting_requests,
                   weight_sync_timeout_s=config.serve.weight_sync_timeout_s).run()
    finally:
        engine.close()
    try:
        channel.send(Stopped())
    except (BrokenPipeError, OSError):
        pass
