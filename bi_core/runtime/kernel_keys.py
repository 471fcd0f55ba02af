"""The same Triton cache key for a kernel in every process, whatever order its kernels launch in.

Triton up to 3.6 builds a kernel's cache key from its source, its callees' keys and the constexpr
globals they read, but its ``DependenciesFinder._update_hash`` merges a callee's globals *before*
it computes the callee's key. The first kernel to reach a helper that reads constexpr globals
therefore leaves them out of its key, and every later kernel includes them. ``e4m3.quant_group``
(it reads ``_FP8_MAX`` and ``_FP8_EPS``) is called by ``fp8._quant_kernel`` and
``norm._rms_norm_kernel``: a recording start launched the norm first, a replaying start keyed the
quantizer first, so each keyed the other's kernel differently, and a fifth of the FP8 35B
manifest's entries were refused as stale (dev/benchmarks-history.md). Triton 3.9 computes the
callee's key first.

``settle`` computes the key of every ``@triton.jit`` function in ``bi_core.kernels`` callees
first, so that each kernel's key holds all its globals, as Triton 3.9's would. Keys are cached on
the functions, so this must run before anything launches or preloads a kernel: compile-ahead and
compile-manifest recordings call it. Computing a key compiles nothing."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

_settled = False


def unwrap(obj, attr: str):
    """``obj``, or the first object down its ``.fn`` chain (Triton's autotuners and heuristics wrap
    the JIT function) that has ``attr``; None if none has (modules and classes never count)."""
    for _ in range(8):
        if obj is None or isinstance(obj, (type, ModuleType)):
            return None
        if hasattr(obj, attr):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def _jit(obj):
    """``obj`` as a JIT function with a cache key and a Python body (through its wrappers), or None."""
    fn = unwrap(obj, "cache_key")
    return fn if hasattr(fn, "fn") and hasattr(fn, "used_global_vals") else None


def callees(fn) -> list:
    """The JIT functions ``fn``'s body names: globals by name (``quant_group``), and attributes of
    modules it names (``tl.sum``, itself a JIT function)."""
    names = fn.fn.__code__.co_names
    scope = fn.__globals__
    found = []
    for name in names:
        val = scope.get(name)
        if isinstance(val, ModuleType):
            found += [j for n in names if (j := _jit(getattr(val, n, None))) is not None]
        elif (j := _jit(val)) is not None:
            found.append(j)
    return [j for j in found if j is not fn]


def settle_functions(functions) -> int:
    """Compute the keys of ``functions`` and everything they call, callees first; returns how many
    functions were visited."""
    seen: set[int] = set()

    def visit(fn) -> None:
        if id(fn) in seen:
            return
        seen.add(id(fn))
        for callee in callees(fn):
            visit(callee)
        fn.cache_key  # noqa: B018  (computed and cached on the function)

    for fn in functions:
        visit(fn)
    return len(seen)


def kernel_functions(package: str = "bi_core.kernels") -> list:
    """Every JIT function defined in ``package``'s modules."""
    pkg = importlib.import_module(package)
    found = []
    for info in pkgutil.iter_modules(pkg.__path__, package + "."):
        module = importlib.import_module(info.name)
        found += [j for v in vars(module).values()
                  if (j := _jit(v)) is not None and j.fn.__module__ == info.name]
    return found


def settle() -> None:
    """Settle the keys of bi_core's kernels, once a process (later calls return at once)."""
    global _settled
    if not _settled:
        settle_functions(kernel_functions())
        _settled = True
