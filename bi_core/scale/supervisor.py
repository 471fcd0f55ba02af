"""Watching the replicas: every ``poll_interval_s`` each replica's server process (through its
actor) and its ``/health``. A replica whose process ended, whose actor is gone or whose
``/health`` failed ``MAX_HEALTH_MISSES`` times in a row is reported (a log line with its exit
status and last log lines; ``failures`` in ``GET /replicas``), taken out of the router and started
again in its bundle (a new actor there when the old one is gone). Once its ``/health`` answers it
goes back into the router, unless the others' weights moved on meanwhile (a weight update it
missed): then it stays out (``stale``) until an update reaches it too.

States: ``starting`` (launched, not answering yet), ``serving`` (in the router), ``stale`` (up,
older weights, out of the router), ``restarting`` (to be launched again at the next round: its last
launch failed), ``failed`` (``MAX_FAILED_STARTS`` starts in a row failed: left down, reported)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import attrs
import httpx
import ray

from bi_core.errors import BiEngineError
from bi_core.scale.router import RouterProcess

log = logging.getLogger("bi_core.scale")
MAX_HEALTH_MISSES = 3
MAX_FAILED_STARTS = 3
MAX_FAILURES_KEPT = 20
STOP_TIMEOUT_S = 10.0  # a replica being replaced: it failed, so it is not drained for long
LIVE = ("serving", "stale")


def _reason(e: Exception) -> str:
    """A Ray error in one line: its type and the last line of its message (a task's error carries the
    remote traceback before it)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1].strip() if lines else 'no message'}"


@attrs.define(eq=False)
class Replica:
    index: int
    actor: object
    url: str | None = None
    pid: int | None = None
    node: str | None = None
    gpus: list[str] = attrs.Factory(list)
    state: str = "starting"
    restarts: int = 0
    failed_starts: int = 0
    health_misses: int = 0
    deadline: float = 0.0
    failures: list[dict] = attrs.Factory(list)

    def status(self) -> dict:
        return {"replica": self.index, "url": self.url, "state": self.state, "pid": self.pid, "node": self.node,
                "gpus": self.gpus, "restarts": self.restarts, "failures": list(self.failures)}


class Supervisor:
    """The replicas' states, and the thread that keeps them serving."""

    def __init__(self, actors: list, spawn: Callable[[int], object], router: RouterProcess, api_key: str | None,
                 poll_interval_s: float, startup_timeout_s: float) -> None:
        self.replicas = [Replica(i, a) for i, a in enumerate(actors)]
        self.spawn, self.router = spawn, router
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self.poll_interval_s, self.startup_timeout_s = poll_interval_s, startup_timeout_s
        self.fleet_weight_version: int | None = None  # set by weight updates that reached every replica
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ start and stop

    def start_all(self) -> list[str]:
        """Launch every replica and wait until all answer; their URLs. A replica that cannot start is
        an error naming it, with its last log lines."""
        for r in self.replicas:
            try:
                self._launch(r)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                raise BiEngineError(f"replica {r.index} could not be launched: {_reason(e)}") from None
        while any(r.state == "starting" for r in self.replicas):
            for r in self.replicas:
                if r.state == "starting" and (why := self._start_problem(r)) is not None:
                    raise BiEngineError(f"replica {r.index} did not start: {why}")
                if r.state == "starting" and self._healthy(r):
                    r.state = "serving"
            time.sleep(0.2)
        return [r.url for r in self.replicas]

    def watch(self) -> None:
        """Start the watching thread."""
        self._thread = threading.Thread(target=self._run, name="bi-engine-supervisor", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop watching, then every replica's server (drained within ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        pending = [(r, r.actor.stop.remote(timeout_s)) for r in self.replicas]
        for r, ref in pending:
            try:
                ray.get(ref, timeout=timeout_s + 10)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
                log.warning("replica %d did not stop cleanly: %s", r.index, e)

    # ------------------------------------------------------------------ what others read

    def live(self) -> list[Replica]:
        """The replicas a control call goes to: up (serving or stale)."""
        with self.lock:
            return [r for r in self.replicas if r.state in LIVE]

    def statuses(self) -> list[dict]:
        with self.lock:
            return [r.status() for r in self.replicas]

    def weights_updated(self, versions: dict[int, int]) -> None:
        """A weight update went out (index -> each replica's weight version now). The serving replicas
        define the fleet's version (all of them agreeing; with none serving, every live one); stale
        replicas that now hold it go back into the router."""
        with self.lock:
            serving = [r for r in self.replicas if r.state == "serving"] or \
                [r for r in self.replicas if r.state in LIVE]
            found = {versions.get(r.index) for r in serving}
            if len(found) == 1 and None not in found:
                self.fleet_weight_version = found.pop()
            for r in self.replicas:
                if r.state == "stale" and versions.get(r.index) == self.fleet_weight_version:
                    self._admit(r)

    # ------------------------------------------------------------------ the watching loop

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one failed check
                log.exception("supervisor check failed; retrying")

    def check(self) -> None:
        """One round: every replica, then the router."""
        for r in self.replicas:
            with self.lock:
                if r.state in LIVE:
                    why = self._process_problem(r) or self._health_problem(r)
                    if why is not None:
                        self._replace(r, why)
                elif r.state == "starting":
                    why = self._start_problem(r)
                    if why is not None:
                        self._failed_start(r, why)
                    elif self._healthy(r):
                        self._admit(r)
                elif r.state == "restarting":
                    self._relaunch(r)
        self._check_router()

    def _check_router(self) -> None:
        code = self.router.returncode()
        if code is None:
            return
        urls = [r.url for r in self.replicas if r.state == "serving"]
        log.error("sglang-router exited with status %s (%s); starting it again with %d replicas", code,
                  self.router.log_tail(3), len(urls))
        self.router.start(urls, self.startup_timeout_s)

    def _process_problem(self, r: Replica) -> str | None:
        try:
            code = ray.get(r.actor.returncode.remote(), timeout=30)
        except ray.exceptions.RayActorError as e:
            return f"its actor died ({type(e).__name__})"
        except ray.exceptions.GetTimeoutError:
            return "its actor did not answer within 30 s"
        if code is None:
            return None
        return f"the server exited with status {code}: {self._tail(r)}"

    def _health_problem(self, r: Replica) -> str | None:
        if self._healthy(r):
            r.health_misses = 0
            return None
        r.health_misses += 1
        if r.health_misses < MAX_HEALTH_MISSES:
            return None
        return f"/health failed {r.health_misses} times in a row"

    def _start_problem(self, r: Replica) -> str | None:
        why = self._process_problem(r)
        if why is None and time.monotonic() > r.deadline:
            why = f"/health did not answer 200 within {self.startup_timeout_s:g} s: {self._tail(r)}"
        return why

    def _healthy(self, r: Replica) -> bool:
        try:
            return httpx.get(f"{r.url}/health", headers=self.headers, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _tail(self, r: Replica) -> str:
        try:
            tail = ray.get(r.actor.log_tail.remote(), timeout=10)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            return "(its log could not be read)"
        return " | ".join(tail.splitlines()) or "(no output)"

    # ------------------------------------------------------------------ transitions

    def _report(self, r: Replica, why: str) -> None:
        log.error("replica %d (%s) failed: %s", r.index, r.url, why)
        r.failures = [*r.failures, {"time": time.time(), "url": r.url, "reason": why}][-MAX_FAILURES_KEPT:]

    def _replace(self, r: Replica, why: str) -> None:
        self._report(r, why)
        if r.state == "serving":
            try:
                self.router.remove(r.url)
            except (httpx.HTTPError, BiEngineError) as e:
                log.error("replica %d: could not take %s out of the router: %s", r.index, r.url, e)
        r.restarts += 1
        self._relaunch(r)

    def _failed_start(self, r: Replica, why: str) -> None:
        self._report(r, f"start failed: {why}")
        r.failed_starts += 1
        if r.failed_starts >= MAX_FAILED_STARTS:
            r.state = "failed"
            log.error("replica %d: %d starts in a row failed; left down", r.index, r.failed_starts)
            return
        self._relaunch(r)

    def _relaunch(self, r: Replica) -> None:
        """Stop what is left of it and launch it again in its bundle (a new actor when the old one is
        gone); a launch that fails is tried again at the next round."""
        r.state = "restarting"
        try:
            try:
                ray.get(r.actor.stop.remote(STOP_TIMEOUT_S), timeout=STOP_TIMEOUT_S + 10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.kill(r.actor, no_restart=True)
                r.actor = self.spawn(r.index)
            self._launch(r)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as e:
            self._report(r, f"could not be launched again: {_reason(e)}")
            r.failed_starts += 1
            if r.failed_starts >= MAX_FAILED_STARTS:
                r.state = "failed"
            return
        log.info("replica %d: started again on %s (restart %d)", r.index, r.url, r.restarts)

    def _launch(self, r: Replica) -> None:
        where = ray.get(r.actor.start.remote(), timeout=60)
        r.url, r.pid, r.node, r.gpus = where["url"], where["pid"], where["node"], where["gpus"]
        r.state, r.health_misses, r.deadline = "starting", 0, time.monotonic() + self.startup_timeout_s

    def _admit(self, r: Replica) -> None:
        version = self._weight_version(r)
        if self.fleet_weight_version is not None and version != self.fleet_weight_version:
            r.state = "stale"
            self._report(r, f"up with weight version {version}, the others have {self.fleet_weight_version}: kept "
                            "out of the router until a weight update reaches it")
            return
        self.router.add(r.url)
        r.state, r.failed_starts = "serving", 0
        log.info("replica %d (%s) is serving", r.index, r.url)

    def _weight_version(self, r: Replica) -> int | None:
        try:
            return httpx.get(f"{r.url}/get_weight_version", headers=self.headers, timeout=5.0).json()["weight_version"]
        except (httpx.HTTPError, KeyError, ValueError):
            return None
