"""Compile ahead: the Triton kernels a start will launch, compiled in a thread pool while the
engine builds its weights and caches, from the manifest an earlier start of the same shape
recorded (``runtime/compile_manifest.py``).

Triton compiles a kernel at its first launch, in the launching thread, one after another; Triton
3.6 then builds the kernel's C launcher with gcc. On a fresh machine that was most of the
default backend's start (issue 22; dev/benchmarks-history.md). ptxas and gcc run as subprocesses
and LLVM releases the GIL, so threads run those parts in parallel (Triton's Python code generator
and MLIR passes hold it, so eight threads gain far less than eight times, with the same cubins).

``start`` (the engine, before its weights) starts a thread that enters Triton's
``AsyncCompileMode`` with a pool and preloads every entry; each pool task compiles, then builds
the kernel's launcher (the launch's own build is then a disk-cache hit). Leaving the mode waits
for the compiles and installs them in the kernels' in-memory caches; the warm-up joins the thread
before its first launch (``CompileAhead.join``).

A manifest can never change results: a kernel is installed only where it compiles to the hash
recorded from the launch that compiled it (the same source, Triton, GPU, options and
specialization); anything else compiles at its first launch, as without a manifest. On CUDA with
Triton >= 3.5 only; ``BI_COMPILE_AHEAD=0`` turns it off."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from bi_core.runtime import kernel_keys
from bi_core.runtime.compile_manifest import (
    RECORD_HOW,
    changed_sources,
    is_recording,
    manifest_key,
    manifest_target,
    read_entries,
    resolve,
)

if TYPE_CHECKING:
    from bi_core.config import EngineConfig
    from bi_core.models.args import ModelArgs
    from bi_core.policies.base import Policy
    from bi_core.registry import Registry

log = logging.getLogger(__name__)

ENV = "BI_COMPILE_AHEAD"
MAX_WORKERS = 16


class StaleEntry(Exception):
    """An entry whose kernel would not compile to its recorded hash (re-record the manifest)."""


@attrs.define
class AheadReport:
    """What one start compiled ahead (the info line the warm-up logs)."""

    entries: int
    compiled: int  # installed in their kernels' in-memory caches (or shared another entry's compile)
    failed: int  # not resolved, not preloaded, or not compiled: each compiles at its first launch
    stale: int  # of ``failed``: the kernel, Triton or its options changed since the recording
    workers: int
    seconds: float  # from the thread's start until every compile was installed
    join_wait_s: float = 0.0  # how long the engine waited for it before the warm-up

    def __str__(self) -> str:
        return (f"compile-ahead: {self.compiled} of {self.entries} Triton kernels compiled ahead in "
                f"{self.workers} threads in {self.seconds:.1f} s ({self.failed} failed, {self.stale} of them "
                f"stale); the start waited {self.join_wait_s:.1f} s for them")


class _LauncherBuilds:
    """The executor ``AsyncCompileMode`` submits compiles to: each task also builds the kernel's
    C launcher (Triton 3.6 runs gcc for it at the first launch, cached on disk: that build is then
    a cache hit), off the launching thread."""

    def __init__(self, pool: ThreadPoolExecutor, build_launcher) -> None:
        self.pool, self.build_launcher, self.futures = pool, build_launcher, []

    def submit(self, compile_fn, /, *args, **kwargs) -> Future:
        future = self.pool.submit(self._task, compile_fn, args, kwargs)
        self.futures.append(future)
        return future

    def _task(self, compile_fn, args, kwargs):
        try:
            kernel = compile_fn(*args, **kwargs)
        except Exception as e:
            log.debug("compile-ahead: a compile failed (%s: %s)", type(e).__name__, e)
            raise
        try:
            self.build_launcher(kernel)
        except Exception as e:  # the launch builds it again
            log.debug("compile-ahead: a launcher build failed (%s: %s)", type(e).__name__, e)
        return kernel


def _checked(mode_cls):
    """``mode_cls`` (Triton's ``AsyncCompileMode``) refusing, before it compiles, any kernel whose
    compile would not be the recorded one: the cache key Triton hands to ``submit`` hashes to the
    compile's hash (``compile`` names its cache entry so)."""
    class Checked(mode_cls):
        expect = ""  # the hash of the entry being preloaded

        def submit(self, key, *rest):
            got = hashlib.sha256(key.encode()).hexdigest()
            if got != self.expect:
                raise StaleEntry(f"compiles to {got[:12]}, recorded {self.expect[:12]}")
            return super().submit(key, *rest)
    return Checked


def _build_launcher(kernel) -> None:
    from triton.runtime.driver import driver

    driver.active.launcher_cls(kernel.src, kernel.metadata)


def replay(entries: list[dict], workers: int, *, mode_cls=None,
           build_launcher=_build_launcher) -> AheadReport:
    """Preload every entry under ``AsyncCompileMode`` with a pool of ``workers`` threads; on
    return every compile is done and installed. An entry that fails is counted and logged (debug)
    and the others go on. ``mode_cls``: Triton's ``AsyncCompileMode`` unless given (tests)."""
    if mode_cls is None:
        from triton.runtime._async_compile import AsyncCompileMode as mode_cls
    t0 = time.perf_counter()
    failed = stale = 0
    with ThreadPoolExecutor(workers, thread_name_prefix="bi-compile-ahead") as pool:
        executor = _LauncherBuilds(pool, build_launcher)
        with _checked(mode_cls)(executor, ignore_errors=True) as mode:  # leaving it waits and installs
            for entry in entries:
                try:
                    mode.expect = entry["hash"]
                    resolve(entry["kernel"]).preload(json.dumps(entry["spec"]))
                except Exception as e:
                    failed, stale = failed + 1, stale + isinstance(e, StaleEntry)
                    log.debug("compile-ahead: %s not preloaded (%s: %s)", entry.get("kernel"),
                              type(e).__name__, e)
    failed += sum(f.exception() is not None for f in executor.futures)
    return AheadReport(entries=len(entries), compiled=len(entries) - failed, failed=failed, stale=stale,
                       workers=workers, seconds=time.perf_counter() - t0)


@attrs.define
class CompileAhead:
    """One engine start's compile-ahead: a thread replaying a manifest, or nothing."""

    path: Path | None = None  # the manifest replayed
    report: AheadReport | None = None
    _thread: threading.Thread | None = None

    def launch(self, entries: list[dict], device_index: int, skipped: int = 0) -> None:
        """Replay ``entries`` in a thread, on CUDA device ``device_index``; ``skipped``: entries of
        the manifest left out as stale (counted in the report)."""
        kernel_keys.settle()  # here, before the thread: the keys a recording computed, in any order
        _create_driver()
        workers = min(MAX_WORKERS, os.cpu_count() or 1)
        self._thread = threading.Thread(target=self._run, args=(entries, device_index, workers, skipped),
                                        name="bi-compile-ahead", daemon=True)
        self._thread.start()

    def _run(self, entries: list[dict], device_index: int, workers: int, skipped: int) -> None:
        try:
            torch.cuda.set_device(device_index)  # Triton keys its kernel caches by the current device
            report = replay(entries, workers)
            report.entries, report.failed, report.stale = (report.entries + skipped, report.failed + skipped,
                                                           report.stale + skipped)
            self.report = report
        except Exception as e:  # never the engine's start: the kernels compile at their first launch
            log.warning("compile-ahead stopped (%s: %s); kernels compile at their first launch",
                        type(e).__name__, e)

    def join(self) -> AheadReport | None:
        """Wait for the replay (once; later calls return at once); logs its report."""
        if self._thread is None:
            return self.report
        t = time.perf_counter()
        self._thread.join()
        self._thread = None
        if self.report is not None:
            self.report.join_wait_s = time.perf_counter() - t
            log.info("%s", self.report)
        return self.report


def _create_driver() -> None:
    """Triton's driver, created here: the pool and the launching thread would race to create it."""
    from triton.runtime.driver import driver

    driver.active  # noqa: B018


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.info("%s", message)


def start(config: EngineConfig, registry: Registry, policy: Policy, args: ModelArgs,
          device: torch.device) -> CompileAhead:
    """Start replaying this start's manifest in a thread (CUDA, Triton >= 3.5, a manifest for its
    key, ``BI_COMPILE_AHEAD`` not 0); else an idle ``CompileAhead``. Call before building weights."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0" or is_recording():
        return CompileAhead()
    try:
        import triton.runtime._async_compile  # noqa: F401  (Triton >= 3.5)
    except ImportError:
        _say_once("compile-ahead: off: this Triton has no AsyncCompileMode (3.5+); kernels compile at their "
                  "first launch")
        return CompileAhead()
    ahead = CompileAhead()
    try:
        fields, path = manifest_target(config, registry, policy, args, device)
        if path is None or not path.exists():
            _say_once(f"compile-ahead: no compile manifest for key {manifest_key(fields)} ({policy.backend}, "
                      f"{fields['capability']}, Triton {fields['triton']}); record one with {RECORD_HOW}")
            return ahead
        entries = read_entries(path, fields)
        changes = [changed_sources(e) for e in entries]
        fresh = [e for e, changed in zip(entries, changes) if not changed]
        if len(fresh) < len(entries):
            changed = sorted({p for c in changes for p in c})
            _say_once(f"compile-ahead: {len(entries) - len(fresh)} of {len(entries)} entries of {path.name} are "
                      f"for kernels whose files changed since it was recorded ({', '.join(changed)}): they "
                      f"compile at their first launch; re-record with {RECORD_HOW}")
        ahead.launch(fresh, device.index if device.index is not None else torch.cuda.current_device(),
                     skipped=len(entries) - len(fresh))
        ahead.path = path
    except Exception as e:  # never the engine's start
        _say_once(f"compile-ahead: off ({type(e).__name__}: {e})")
    return ahead
