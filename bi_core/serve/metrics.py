"""Metrics of a server. The engine process counts (``Counts``: plain data, sent with each batch
of outputs); the HTTP process keeps the Prometheus registry (``Metrics``) and applies them."""

from __future__ import annotations

import collections

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FINISH_REASONS = ("stop", "length", "abort", "error")


@attrs.define
class Counts:
    """What the engine loop saw since the last report, and the engine's state now."""

    step_seconds: list[float] = attrs.Factory(list)
    generated: int = 0
    prompt_tokens: int = 0
    finished: dict[str, int] = attrs.Factory(dict)  # by finish reason
    state: dict[str, float] = attrs.Factory(dict)  # gauges: running, waiting, pages_used, ...

    def __bool__(self) -> bool:
        return bool(self.step_seconds or self.generated or self.prompt_tokens or self.finished or self.state)


class StepCounter:
    """The engine side: counts steps, tokens and finishes; ``take()`` hands them over and restarts."""

    def __init__(self) -> None:
        self.counts = Counts()
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._state: dict[str, float] = {}  # as last handed over

    def step(self, seconds: float, generated: int) -> None:
        self.counts.step_seconds.append(seconds)
        self.counts.generated += generated
        self._recent.append((seconds, generated))

    def finished(self, reason: str) -> None:
        self.counts.finished[reason] = self.counts.finished.get(reason, 0) + 1

    def take(self, engine) -> Counts:
        """The counts since the last call, with the engine's state when it changed: read at every
        hand-over, not only after steps, since an abort or an add changes it between steps."""
        sched, total_s = engine.scheduler, sum(dt for dt, _ in self._recent)
        state = {"running": len(sched.running), "waiting": len(sched.waiting),
                 "pages_used": sched.num_pages_used, "pages_total": engine.cache.num_blocks,
                 "preemptions": sched.num_preemptions,
                 "tokens_per_s": sum(n for _, n in self._recent) / total_s if total_s else 0.0}
        if state != self._state:
            self.counts.state = self._state = state
        counts, self.counts = self.counts, Counts()
        return counts


class Metrics:
    """The Prometheus side (its own registry, so several servers can share a process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("bi_requests_running", "requests with KV pages and a state slot", registry=r)
        self.waiting = Gauge("bi_requests_waiting", "requests queued for admission", registry=r)
        self.pages_used = Gauge("bi_kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_total = Gauge("bi_kv_pages_total", "KV cache pages", registry=r)
        self.tokens_per_s = Gauge("bi_generation_tokens_per_second", "tokens generated per second over the "
                                  "last steps (up to 64)", registry=r)
        self.generated = Counter("bi_generation_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("bi_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.preemptions = Gauge("bi_preemptions", "requests preempted and recomputed so far (default mode)",
                                 registry=r)
        self.finished = Counter("bi_requests_finished", "finished requests by reason", ["reason"], registry=r)
        for reason in FINISH_REASONS:  # exported from the start, at 0
            self.finished.labels(reason)
        self.step_seconds = Histogram("bi_step_seconds", "engine step time", registry=r,
                                      buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))

    def apply(self, c: Counts) -> None:
        for s in c.step_seconds:
            self.step_seconds.observe(s)
        self.generated.inc(c.generated)
        self.prompt_tokens.inc(c.prompt_tokens)
        for reason, n in c.finished.items():
            self.finished.labels(reason).inc(n)
        for name, value in c.state.items():
            getattr(self, name).set(value)
