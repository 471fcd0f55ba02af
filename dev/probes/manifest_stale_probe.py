"""Why a compile-manifest entry is stale (its replay compiles to another hash than recorded): runs
``benchmarks/start_time.py CONFIG`` in this process with Triton's cache key spied on, and prints,
for each kernel named on the command line, the parts of every key computed for it: at the
compile-ahead's replay (preload) and at the launches that then compiled lazily. The parts that
differ between a replay and a launch of the same specialization are the cause.

    TRITON_CACHE_DIR=$(mktemp -d) python3 dev/probes/manifest_stale_probe.py CONFIG KERNEL [KERNEL...] [-- START_TIME_ARGS]
"""

from __future__ import annotations

import hashlib
import logging
import runpy
import sys
import threading

import triton.compiler.compiler as compiler
import triton.runtime.jit as jit

config, rest = sys.argv[1], sys.argv[2:]
extra = rest[rest.index("--") + 1:] if "--" in rest else []  # start_time.py's own options, e.g. --record-compiles PATH
names = set(rest[:rest.index("--")] if "--" in rest else rest)
seen: list[dict] = []
_orig = compiler.get_cache_key


def _spy(src, backend, options, env_vars):
    key = _orig(src, backend, options, env_vars)
    fn = getattr(src, "fn", None)
    name = (getattr(fn, "_fn_name", None) or getattr(fn, "__name__", "?")).rpartition(".")[2]  # Triton may qualify it
    if name in names:
        seen.append({"fn": name, "thread": threading.current_thread().name, "hash": hashlib.sha256(key.encode()).hexdigest()[:12],
                     "fn_key": fn.cache_key[:12], "attrs": str(src.attrs), "sig": str(sorted(src.signature.items())),
                     "consts": str(sorted(src.constants.items())), "backend": backend.hash()[:12],
                     "options": options.hash()[:12], "options_full": str(sorted(options.__dict__.items())),
                     "env": str(sorted(env_vars.items())),
                     "globals": str(getattr(fn, "used_global_vals", {}))[:400]})
    return key


compiler.get_cache_key = jit.get_cache_key = _spy
logging.basicConfig(level=logging.WARNING)
logging.getLogger("bi_core.runtime.compile_ahead").setLevel(logging.DEBUG)
sys.argv = ["benchmarks/start_time.py", config, *extra]
try:
    runpy.run_path("benchmarks/start_time.py", run_name="__main__")
finally:
    print(f"== {len(seen)} keys computed for {sorted(names)}")
    by_sig: dict[tuple, list[dict]] = {}
    for s in seen:
        by_sig.setdefault((s["fn"], s["sig"], s["consts"]), []).append(s)
    for (fn, _sig, consts), group in by_sig.items():
        print(f"-- {fn} {consts}: " + ", ".join(f"{g['thread']}:{g['hash']}" for g in group))
        if len({g["hash"] for g in group}) > 1:
            first = group[0]
            for g in group[1:]:
                diff = {k: (first[k], g[k]) for k in first if k not in ("thread", "hash") and first[k] != g[k]}
                print(f"   differs ({first['thread']} vs {g['thread']}): {diff}")
    for name in sorted(names):
        first = next((s for s in seen if s["fn"] == name), None)
        if first:
            print(f"first {name}:", {k: v for k, v in first.items() if k not in ("globals",)})
    from bi_core.kernels import e4m3
    print("quant_group", e4m3.quant_group.cache_key[:12], "round_e4m3", e4m3.round_e4m3.cache_key[:12],
          "globals", {k[0]: repr(v[0]) for k, v in getattr(e4m3.quant_group, "used_global_vals", {}).items()})
