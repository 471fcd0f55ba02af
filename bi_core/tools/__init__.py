"""The CLI's tools, kept apart from the engine core: the benchmarks (``bench``), the report behind
``bi-engine bench`` (``bench_report``), the invariance audit behind ``bi-engine verify`` (``verify``),
the probes that name the first op whose output depends on the batch (``diagnose``) and the
generator of docs/configuration.md from the config classes (``config_doc``). They are built on the
engine's public API (``build_engine``, ``LLMEngine``, ``SamplingParams``) and are not
part of the engine: nothing in the engine imports them. Where a tool needs more than that API (the
per-op probes, the timed decode steps) it reads engine internals and follows them when they change."""
