"""Generation control around a weight sync: pause, resume, abort everything, reset the prefix cache
(vLLM's ``pause_generation(mode, clear_cache)`` semantics, in a synchronous engine), and sleep /
wake for a trainer sharing the GPU (vLLM's ``sleep(level)`` / ``wake_up(tags)``; the memory is
released and allocated again by the model runner, ``runtime/runner.py``).

Modes:
- ``abort``: every unfinished request ends now, ``finish_reason='abort'``.
- ``wait``: the requests that have started run to their end (steps run inside the call); the
  queued ones that have not started are held back meanwhile (admitted after ``resume``).
- ``keep``: everything stays where it is; after ``resume`` the requests go on from where they
  were, nothing lost or recomputed: the same bits as an uninterrupted run.

While paused or asleep ``step()`` runs nothing and returns []; requests may still be added (they
wait); ``generate``/``score`` raise (they would wait forever). Sleep needs every started request
ended (pause first); queued ones wait through it. ``clear_cache`` drops the prefix cache
(the KV pages and states of running requests are theirs, so ``keep`` still loses nothing).

Tensor parallel: the pause itself needs no message (the other ranks step only when rank 0 says
so); what changes scheduling does: the aborts (``Abort``), holding and releasing the queued
requests around a ``wait`` drain (``HoldAdmissions``/``ReleaseAdmissions``) and the prefix-cache
reset (``ResetPrefixCache``); sleep and wake (``Sleep``, ``WakeUp``) run on every rank."""

from __future__ import annotations

import torch

from bi_core.errors import RequestError
from bi_core.parallel import lockstep
from bi_core.policies.apply import applied
from bi_core.rl.coverage import WeightsMissing
from bi_core.rl.receiver import started
from bi_core.runtime.warmup import capture_graphs, wants_warmup

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (1, 2)  # 1: weights to host memory; 2: weights dropped (a weight update refills them)
WAKE_TAGS = ("weights", "kv_cache")


class RolloutControl:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.paused = False
        self.mode: str | None = None  # the last pause's mode, while paused
        self._held: list = []  # queued requests held back during a ``wait`` drain

    def pause(self, mode: str, clear_cache: bool) -> None:
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause_generation: mode {mode!r} is not one of {', '.join(map(repr, PAUSE_MODES))}")
        if mode == "abort":
            self.engine.abort_all()
        elif mode == "wait":
            self._drain()
        self.paused, self.mode = True, mode
        if clear_cache:
            self.reset_prefix_cache()

    def resume(self) -> None:
        self.paused, self.mode = False, None

    def refuse_if_idle(self, what: str) -> None:
        """``generate``/``score`` would wait forever (paused or asleep), or serve garbage (the
        weights are missing: a level-2 sleep, a broken update): one error before any prompt."""
        if self.paused:
            raise RequestError(f"{what}: the engine is paused (pause_generation(mode={self.mode!r})); it would wait "
                               "forever. Call resume_generation() first")
        self.refuse_if_asleep(what)
        try:
            self.engine.weight_sync.check_serving()
        except WeightsMissing as e:
            raise WeightsMissing(f"{what}: {e}") from None

    def refuse_if_asleep(self, what: str, part: str | None = None) -> None:
        """RequestError while the engine sleeps (``part``: while that part of it does)."""
        asleep = self.engine.runner.sleeping
        if asleep and (part is None or part in asleep):
            raise RequestError(f"{what}: the engine's {' and '.join(sorted(asleep))} are asleep (sleep level "
                               f"{self.engine.runner.sleep_level}); wake_up(tags={sorted(asleep)!r}) first")

    # ------------------------------------------------------------------ sleep / wake

    def sleep(self, level: int) -> None:
        if level not in SLEEP_LEVELS or isinstance(level, bool):
            raise RequestError(f"sleep: level must be 1 (weights to host memory) or 2 (weights dropped), got {level!r}")
        if self.engine.runner.sleeping:
            raise RequestError(f"sleep: already asleep ({', '.join(sorted(self.engine.runner.sleeping))}); "
                               "wake_up first")
        begun = [rid for rid, s in self.engine.requests.items() if started(s)]
        if begun:
            raise RequestError(f"sleep: {len(begun)} request(s) have started (e.g. request {begun[0]}) and hold "
                               "cache memory; pause_generation(mode='abort' or 'wait') first")
        self.engine._mirror(lockstep.Sleep(level), now=True)
        self.engine.runner.sleep(level)
        if level == 2:  # nothing to serve with until a weight update has filled them again
            self.engine.weight_sync.released()

    def wake_up(self, tags: list[str] | None) -> None:
        if tags is not None and (isinstance(tags, str) or not set(tags) <= set(WAKE_TAGS) or not tags):
            raise RequestError(f"wake_up: tags must be a non-empty list of {', '.join(WAKE_TAGS)} (or None: all), "
                               f"got {tags!r}")
        e = self.engine
        e._mirror(lockstep.WakeUp(None if tags is None else tuple(tags)), now=True)
        e.runner.wake_up(None if tags is None else list(tags))
        if not e.runner.sleeping and wants_warmup(e):
            with torch.inference_mode(), applied(e.policy):  # as at start: no capture inside a running batch
                capture_graphs(e)

    def reset_prefix_cache(self) -> bool:
        prefix = self.engine.cache.prefix
        if prefix is None:
            return False
        self.engine._mirror(lockstep.ResetPrefixCache())
        prefix.clear()
        return True

    def _drain(self) -> None:
        """Run the started requests to their end, the queued ones held back."""
        e = self.engine
        e._mirror(lockstep.HoldAdmissions())
        self.hold_admissions()
        try:
            while e.scheduler.has_work():
                e._step()
        finally:
            e._mirror(lockstep.ReleaseAdmissions())
            self.release_admissions()

    def hold_admissions(self) -> None:
        """Take the queued requests that have not started out of the scheduler's queue (a preempted
        request is queued too, but it has started: it stays, to finish)."""
        self._held = self.engine.scheduler.hold(keep=started)

    def release_admissions(self) -> None:
        self.engine.scheduler.release(self._held)
        self._held = []
