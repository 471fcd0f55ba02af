"""Prometheus metrics of a server (its own registry, so several servers can share a process)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
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
        self.step_seconds = Histogram("bi_step_seconds", "engine step time", registry=r,
                                      buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))

    def observe_step(self, engine, seconds: float, generated: int, recent: Iterable[tuple[float, int]]) -> None:
        sched = engine.scheduler
        self.step_seconds.observe(seconds)
        self.generated.inc(generated)
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.pages_used.set(sched.num_pages_used)
        self.pages_total.set(engine.cache.num_blocks)
        self.preemptions.set(sched.num_preemptions)
        total_s, total_tokens = 0.0, 0
        for dt, n in recent:
            total_s, total_tokens = total_s + dt, total_tokens + n
        self.tokens_per_s.set(total_tokens / total_s if total_s else 0.0)
