"""Metrics of a server. The engine process counts (``Counts``: plain data, sent with each batch
of outputs); the HTTP process keeps the Prometheus registry (``Metrics``) and applies them.

Every figure is exported twice: under bi-engine's names (``bi_*``) and under vLLM's
(``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ... with vLLM's labels ``model_name``
and ``engine``), so routers and autoscalers that read vLLM's metrics (llm-d, sgl-router, Ray Serve)
work unchanged. vLLM's names and buckets follow its v1 ``PrometheusStatLogger``; its deprecated
``vllm:gpu_cache_usage_perc`` is kept beside ``vllm:kv_cache_usage_perc`` for older readers."""

from __future__ import annotations

import collections

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
NOT_EXPORTED = ("tokens_waiting", "tokens_total")  # state read by /v1/loads, not Prometheus gauges
DEFAULT_MAX_MODEL_LEN = 1 << 20  # token histograms' top bucket when the config leaves max_model_len to the checkpoint


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


@attrs.define
class Counts:
    """What the engine loop saw since the last report, and the engine's state now."""

    step_seconds: list[float] = attrs.Factory(list)
    generated: int = 0
    prompt_tokens: int = 0
    finished: dict[str, int] = attrs.Factory(dict)  # by finish reason
    state: dict[str, float] = attrs.Factory(dict)  # gauges: running, waiting, pages_used, ...
    # per request (each of a prompt's n samples is one): seconds from its add to its first token, between
    # the deltas that followed, from its add to its end; its prompt and generated tokens at its end
    ttft: list[float] = attrs.Factory(list)
    itl: list[float] = attrs.Factory(list)
    e2e: list[float] = attrs.Factory(list)
    request_prompt_tokens: list[int] = attrs.Factory(list)
    request_generation_tokens: list[int] = attrs.Factory(list)
    iteration_tokens: list[int] = attrs.Factory(list)  # per step: prompt tokens computed + tokens generated
    # finished requests' prompt tokens, and those of them the prefix cache served (vLLM's prefix-cache
    # queries and hits, in tokens)
    prefix_queried: int = 0
    prefix_hits: int = 0

    def __bool__(self) -> bool:
        return bool(self.step_seconds or self.generated or self.prompt_tokens or self.finished or self.state
                    or self.ttft or self.itl or self.e2e or self.iteration_tokens or self.prefix_queried)


class StepCounter:
    """The engine side: counts steps, tokens and finishes; ``take()`` hands them over and restarts."""

    def __init__(self) -> None:
        self.counts = Counts()
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=64)
        self._state: dict[str, float] = {}  # as last handed over

    def step(self, seconds: float, generated: int, prompt_computed: int = 0) -> None:
        """One step: its time and tokens (the generated ones are counted in ``counts.generated`` as
        they are sent, also those a control call's steps made)."""
        self.counts.step_seconds.append(seconds)
        self.counts.iteration_tokens.append(generated + prompt_computed)
        self._recent.append((seconds, generated))

    def finished(self, reason: str) -> None:
        self.counts.finished[reason] = self.counts.finished.get(reason, 0) + 1

    def take(self, engine, held: int = 0) -> Counts:
        """The counts since the last call, with the engine's state when it changed: read at every
        hand-over, not only after steps, since an abort or an add changes it between steps.
        ``held``: requests the loop holds while generation is paused or the engine sleeps."""
        sched, total_s = engine.scheduler, sum(dt for dt, _ in self._recent)
        state = {"running": len(sched.running), "waiting": len(sched.waiting), "held": held,
                 "pages_used": sched.num_pages_used, "pages_total": engine.cache.num_blocks,
                 "tokens_running": sum(seq.num_tokens for seq in sched.running),
                 # the waiting prompts' tokens, and the cache's capacity in tokens (SGLang's /v1/loads)
                 "tokens_waiting": sum(len(seq.prompt_ids) for seq in sched.waiting),
                 "tokens_total": engine.cache.num_blocks * engine.cache.block_size,
                 "preemptions": sched.num_preemptions, "weight_version": engine.weight_version,
                 "tokens_per_s": sum(n for _, n in self._recent) / total_s if total_s else 0.0}
        if state != self._state:
            self.counts.state = self._state = state
        counts, self.counts = self.counts, Counts()
        return counts


class Metrics:
    """The Prometheus side (its own registry, so several servers can share a process)."""

    def __init__(self, model_name: str = "", max_model_len: int | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("bi_requests_running", "requests with KV pages and a state slot", registry=r)
        self.waiting = Gauge("bi_requests_waiting", "requests queued for admission", registry=r)
        self.held = Gauge("bi_requests_held", "requests held until generation resumes (paused, or the engine "
                          "sleeps)", registry=r)
        self.pages_used = Gauge("bi_kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_total = Gauge("bi_kv_pages_total", "KV cache pages", registry=r)
        self.tokens_running = Gauge("bi_tokens_running", "tokens (prompt and generated so far) of the running "
                                    "requests", registry=r)
        self.prefix_queried = Counter("bi_prefix_cache_queried_tokens", "prompt tokens of finished requests "
                                      "(looked up in the prefix cache)", registry=r)
        self.prefix_hits = Counter("bi_prefix_cache_hit_tokens", "prompt tokens of finished requests that the "
                                   "prefix cache served", registry=r)
        self.state: dict[str, float] = {}  # the engine's last reported state (what /get_load reads)
        self.num_prefix_queried = self.num_prefix_hits = 0  # the counters' totals, for /v1/loads' hit rate
        self.tokens_per_s = Gauge("bi_generation_tokens_per_second", "tokens generated per second over the "
                                  "last steps (up to 64)", registry=r)
        self.generated = Counter("bi_generation_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("bi_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.preemptions = Gauge("bi_preemptions", "requests preempted and recomputed so far (default mode)",
                                 registry=r)
        self.weight_version = Gauge("bi_weight_version", "the engine's weight version (weight updates so far, "
                                    "or the version the last update set)", registry=r)
        self.finished = Counter("bi_requests_finished", "finished requests by reason", ["reason"], registry=r)
        for reason in FINISH_REASONS:  # exported from the start, at 0
            self.finished.labels(reason)
        self.step_seconds = Histogram("bi_step_seconds", "engine step time", registry=r,
                                      buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
        self.vllm = VllmMetrics(r, model_name, max_model_len or DEFAULT_MAX_MODEL_LEN)

    def apply(self, c: Counts) -> None:
        for s in c.step_seconds:
            self.step_seconds.observe(s)
        self.generated.inc(c.generated)
        self.prompt_tokens.inc(c.prompt_tokens)
        for reason, n in c.finished.items():
            self.finished.labels(reason).inc(n)
        self.prefix_queried.inc(c.prefix_queried)
        self.prefix_hits.inc(c.prefix_hits)
        self.num_prefix_queried += c.prefix_queried
        self.num_prefix_hits += c.prefix_hits
        for name, value in c.state.items():
            if name not in NOT_EXPORTED:
                getattr(self, name).set(value)
        self.state.update(c.state)
        self.vllm.apply(c)


class VllmMetrics:
    """The same figures under vLLM's names and labels."""

    def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        names, values = ["model_name", "engine"], {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**values)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, names, registry=r, buckets=buckets).labels(**values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage. "
                                     "DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                                            "of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                                         "cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=r)
        self.success = {reason: success.labels(**values, finished_reason=reason) for reason in FINISH_REASONS}
        self._success = success
        self._values = values
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", ITERATION_TOKEN_BUCKETS)
        self._preemptions_seen = 0.0

    def apply(self, c: Counts) -> None:
        self.prompt_tokens.inc(c.prompt_tokens)
        self.generation_tokens.inc(c.generated)
        self.prefix_cache_queries.inc(c.prefix_queried)
        self.prefix_cache_hits.inc(c.prefix_hits)
        for reason, n in c.finished.items():
            counter = self.success.get(reason)
            if counter is None:
                counter = self.success[reason] = self._success.labels(**self._values, finished_reason=reason)
            counter.inc(n)
        for values, hist in ((c.ttft, self.ttft), (c.itl, self.itl), (c.e2e, self.e2e),
                             (c.request_prompt_tokens, self.request_prompt_tokens),
                             (c.request_generation_tokens, self.request_generation_tokens),
                             (c.iteration_tokens, self.iteration_tokens)):
            for v in values:
                hist.observe(v)
        s = c.state
        if "running" in s:
            self.running.set(s["running"])
            self.waiting.set(s["waiting"])
            usage = s["pages_used"] / s["pages_total"] if s["pages_total"] else 0.0
            self.kv_cache_usage.set(usage)
            self.gpu_cache_usage.set(usage)
            if s["preemptions"] > self._preemptions_seen:  # the engine's count is cumulative; vLLM's is a counter
                self.preemptions.inc(s["preemptions"] - self._preemptions_seen)
                self._preemptions_seen = s["preemptions"]
