"""Where an engine's start goes (issue 22: the default backend took 170-200 s on a fresh H200).

    python3 benchmarks/start_time.py CONFIG [--num-layers N] [--record-fla PATH] [--record-compiles [PATH]]
                                     [--prefill 8x2048] [--profile PATH]

Prints, for one process: the imports, the engine build (weights, caches, kernels chosen), the
warm-up (graph captures, dummy prompts), and inside them the Triton compiles and autotuning
(kernels compiled or timed, seconds; the C launchers Triton builds with the system compiler) and
fla's autotuners that chose by timing. Run it twice
with one ``TRITON_CACHE_DIR``: the first on an empty directory is a fresh machine's start, the
second a warm one. ``--record-fla`` writes what fla's autotuners chose (the table
``bi_core/backends/cuda_common/fla_configs/sm90.json`` is such a file); ``--record-compiles``
writes the start's Triton compiles as a compile manifest (``bi_core/runtime/compile_manifest.py``;
default: the backend's shipped folder, named by the start's key; the start records without
replaying one); ``--prefill`` times fresh prompts after the start (so that a table's configs can
be compared with autotuned ones); ``--profile`` writes the start's cProfile (sorted by cumulative
time) there.

Compiles and C builds are counted in the launching thread (``triton``); those of the
compile-ahead's threads are ``compiles_ahead`` / ``c_builds_ahead``, and ``compile_ahead`` says
what it replayed. Without the warm-up in the build (as here), the engine joins the compile-ahead
at the end of its build: ``build_s`` includes ``compile_ahead.join_wait_s``."""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import collections  # noqa: E402
import cProfile  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from contextlib import nullcontext  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

T_TORCH = time.perf_counter()

import attrs  # noqa: E402

from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402
from bi_core.runtime.engine import LLMEngine  # noqa: E402
from bi_core.runtime.warmup import warm_up  # noqa: E402

T_IMPORTS = time.perf_counter()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def in_launching_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class Hooks:
    """Seconds and counts of Triton compiles (in-memory misses: a disk-cache hit is a fast
    compile) and autotuner timings, per kernel, in the launching thread; the compile-ahead's
    preloads and launcher builds (other threads) are only counted."""

    def __init__(self) -> None:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction

        self.compiles: dict[str, list[float]] = collections.defaultdict(list)
        self.benches: dict[str, list[float]] = collections.defaultdict(list)
        self.depth = 0
        compile_fn, bench_fn = getattr(JITFunction, "_do_compile", None), Autotuner._bench
        hooks = self

        self.variants: dict[str, list[dict]] = collections.defaultdict(list)

        self.compiles_ahead = 0

        def timed_compile(jit, *args, **kwargs):
            if not in_launching_thread():  # a preload: the compile itself runs in the pool
                hooks.compiles_ahead += 1
                return compile_fn(jit, *args, **kwargs)
            t = time.perf_counter()
            try:
                return compile_fn(jit, *args, **kwargs)
            finally:
                hooks.compiles[jit.__name__].append(time.perf_counter() - t)
                # (key, signature, device, constexprs, options, attrs, warmup): what makes a variant
                names = ("key", "signature", "device", "constexprs", "options", "attrs")
                hooks.variants[jit.__name__].append({n: repr(a) for n, a in zip(names, args) if n != "device"})

        def timed_bench(tuner, *args, **kwargs):
            t = time.perf_counter()
            try:
                return bench_fn(tuner, *args, **kwargs)
            finally:
                hooks.benches[tuner.base_fn.__name__].append(time.perf_counter() - t)

        self.hooked = compile_fn is not None  # JITFunction._do_compile: Triton 3.x's in-memory miss
        if self.hooked:
            JITFunction._do_compile = timed_compile
        Autotuner._bench = timed_bench

        # C sources Triton builds with the system compiler (3.6: a launcher per kernel signature,
        # at the kernel's first launch, outside _do_compile; cached on disk like the kernels)
        import triton.runtime.build as build

        self.builds: list[float] = []
        self.builds_ahead = 0
        build_fn = getattr(build, "_build", None)

        def timed_build(*args, **kwargs):
            if not in_launching_thread():
                hooks.builds_ahead += 1
                return build_fn(*args, **kwargs)
            t = time.perf_counter()
            try:
                return build_fn(*args, **kwargs)
            finally:
                hooks.builds.append(time.perf_counter() - t)

        if build_fn is not None:
            build._build = timed_build

    def differences(self) -> dict:
        """For each kernel compiled more than once, what differs between its variants (by field)."""
        out = {}
        for name, variants in self.variants.items():
            if len(variants) > 1:
                out[name] = {f: sorted({v[f] for v in variants}) for f in variants[0]
                             if f != "key" and len({v[f] for v in variants}) > 1}
        return out

    def report(self) -> dict:
        def top(d):
            rows = sorted(((sum(v), len(v), k) for k, v in d.items()), reverse=True)
            return [{"kernel": k, "count": n, "s": round(s, 2)} for s, n, k in rows]
        return {"compile_hook": self.hooked, "compile_s": round(sum(map(sum, self.compiles.values())), 2),
                "compiles": sum(map(len, self.compiles.values())), "compiles_ahead": self.compiles_ahead,
                "c_builds": len(self.builds), "c_build_s": round(sum(self.builds), 2),
                "c_builds_ahead": self.builds_ahead,
                "autotune_bench_s": round(sum(map(sum, self.benches.values())), 2),
                "autotune_candidates_timed": sum(map(len, self.benches.values())),
                "compile_by_kernel": top(self.compiles), "autotune_by_kernel": top(self.benches)}


def time_prefill(engine: LLMEngine, n: int, length: int) -> float:
    """tok/s of ``n`` fresh prompts of ``length`` tokens (one output token each), after one round of
    other fresh prompts; no prompt shares a prefix with another (random ids, distinct seeds)."""
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    rounds = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        prompts = torch.randint(0, engine.args.vocab_size, (n, length), generator=g).tolist()
        sync()
        t = time.perf_counter()
        engine.generate(prompts, params)
        sync()
        rounds.append(n * length / (time.perf_counter() - t))
    return rounds[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--record-fla", metavar="PATH", help="write what fla's autotuners chose (JSON)")
    p.add_argument("--record-compiles", metavar="PATH", nargs="?", const="",
                   help="write the start's Triton compiles as a compile manifest (default: the backend's folder)")
    p.add_argument("--prefill", default="", help="NxLEN: time N fresh prompts of LEN tokens after the start")
    p.add_argument("--profile", metavar="PATH", help="cProfile of the start, sorted by cumulative time")
    p.add_argument("--variants", metavar="PATH", help="write what differs between a kernel's compiled variants")
    args = p.parse_args()

    config = EngineConfig.from_yaml(args.config)
    if args.num_layers:
        config = config.replace(model={"random": attrs.evolve(config.model.random, num_hidden_layers=args.num_layers)})
    config = config.replace(graph={"warmup": False})  # run apart below, to time it apart
    hooks = Hooks()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    recording = nullcontext()
    if args.record_compiles is not None:  # (imported here: start_time.py also times trees from before it)
        from bi_core.runtime import compile_manifest

        recording = compile_manifest.recording()
    with recording as recorded:
        t_build = time.perf_counter()
        engine = build_engine(config)
        sync()
        t_warm = time.perf_counter()
        build_hooks = hooks.report()
        report = warm_up(engine)
        t_end = time.perf_counter()
    if prof:
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats("cumulative")
        stats.print_stats(60)
        stats.print_stats("bi_core", 40)  # the engine's own functions
        stats.print_callers("_register_to_dispatcher|builtins.compile|_find_and_load'", 12)
        with open(args.profile, "w") as f:
            f.write(out.getvalue())

    # fla_tuning: absent from trees before the table (start_time.py also times those, as old trees)
    has_fla = importlib.util.find_spec("fla") is not None and \
        importlib.util.find_spec("bi_core.backends.cuda_common.fla_tuning") is not None
    if has_fla:
        from bi_core.backends.cuda_common import fla_tuning
    result = {
        "config": args.config, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "triton_cache": os.environ.get("TRITON_CACHE_DIR"),
        "import_torch_s": round(T_TORCH - T0, 2), "import_bi_core_s": round(T_IMPORTS - T_TORCH, 2),
        "build_s": round(t_warm - t_build, 2), "warmup_s": round(t_end - t_warm, 2),
        "engine_start_s": round(t_end - t_build, 2), "process_s": round(t_end - T0, 2),
        "warmup": str(report), "build_triton": {k: build_hooks[k] for k in ("compile_s", "compiles",
                                                                          "autotune_bench_s")},
        "triton": hooks.report(), "compile_ahead": compile_ahead_report(engine, hooks),
    }
    if args.prefill:
        n, length = map(int, args.prefill.split("x"))
        result["prefill_tok_s"] = round(time_prefill(engine, n, length))
        result["triton_after_prefill"] = {k: hooks.report()[k] for k in ("compile_s", "compiles", "autotune_bench_s")}
    chosen = fla_tuning.record() if has_fla else {}  # after the prefill: every key the engine met
    result["fla_chose_by_timing"] = sorted(chosen)
    print(json.dumps(result, indent=1), flush=True)
    if args.variants:
        with open(args.variants, "w") as f:
            json.dump(hooks.differences(), f, indent=1)
    if args.record_fla:
        import fla

        table = {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                 "triton": triton.__version__, "fla": fla.__version__, "torch": torch.__version__,
                 "recorded_with": "python3 benchmarks/start_time.py " + " ".join(sys.argv[1:]), "kernels": chosen}
        with open(args.record_fla, "w") as f:
            json.dump(table, f, indent=1)
        print(f"fla choices of {len(chosen)} kernels written to {args.record_fla}")
    if args.record_compiles is not None:
        record_compiles(engine, recorded, args.record_compiles)


def compile_ahead_report(engine: LLMEngine, hooks: Hooks) -> dict:
    """What the start compiled ahead, and what still compiled in the launching thread (build and
    warm-up: a kernel compiled ahead is an in-memory hit at its launch)."""
    ahead = getattr(engine, "compile_ahead", None)  # absent from trees before compile-ahead
    r = ahead.report if ahead is not None else None
    out = {"manifest": str(ahead.path) if ahead is not None and ahead.path else None,
           "lazy_compiles": hooks.report()["compiles"], "lazy_c_builds": len(hooks.builds)}
    if r is not None:
        out.update(entries=r.entries, compiled=r.compiled, failed=r.failed, stale=r.stale, workers=r.workers,
                   s=round(r.seconds, 2), join_wait_s=round(r.join_wait_s, 2))
    return out


def record_compiles(engine: LLMEngine, recorded, path: str) -> None:
    from bi_core.runtime import compile_manifest

    if engine.device.type != "cuda":
        sys.exit("--record-compiles records the Triton compiles of a CUDA start")
    fields, shipped = compile_manifest.manifest_target(engine.config, engine.registry, engine.policy, engine.args,
                                                       engine.device)
    path = path or shipped
    if not path:
        sys.exit(f"backend {engine.policy.backend} ships no compile manifests: give --record-compiles a PATH")
    entries = recorded.entries()
    compile_manifest.write_manifest(path, fields, entries, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                    recorded_with="python3 benchmarks/start_time.py " + " ".join(sys.argv[1:]),
                                    triton_cache=os.environ.get("TRITON_CACHE_DIR"))
    print(f"{len(entries)} Triton compiles written to {path} ({recorded.unrecorded} not recordable)")


if __name__ == "__main__":
    main()
