"""Where a timed pass's host time went, beside its wall time (the eager prefill is host-bound, and
its wall time moved by more than half between processes over the same kernels:
dev/benchmarks-history.md):

- the launching thread's CPU time (a CUDA wait spins, so it counts there too);
- the other threads' CPU time by name: a busy thread competes for the GIL or a core;
- Python's garbage collections (count and time, by ``gc.callbacks``);
- the CUDA caching allocator's device allocations and frees (``cudaFree`` synchronizes the device);
- the machine's steal time (a virtual machine's CPUs run by its host for someone else)."""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time

import attrs
import torch


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Each thread of this process: its name and CPU seconds (user + system) so far, from
    /proc/self/task (in clock ticks); {} where there is no /proc."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    out = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        rest = stat[stat.rindex(")") + 2:].split()  # fields 3.. of proc(5)'s stat: utime is 14, stime 15
        out[int(tid)] = (stat[stat.index("(") + 1:stat.rindex(")")], (int(rest[11]) + int(rest[12])) / tick)
    return out


def other_threads_cpu(before: dict, after: dict, main_tid: int) -> dict[str, float]:
    """CPU seconds the process's other threads used between two ``thread_cpu`` snapshots, by thread
    name (largest first); a thread that ended meanwhile is not counted."""
    by_name: dict[str, float] = {}
    for tid, (name, t) in after.items():
        if tid != main_tid:
            by_name[name] = by_name.get(name, 0.0) + t - before.get(tid, (name, 0.0))[1]
    return dict(sorted(((n, t) for n, t in by_name.items() if t > 0), key=lambda nt: -nt[1]))


def _steal() -> tuple[int, int] | None:
    """The machine's (steal, total) CPU ticks so far, from /proc/stat; None without it."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks[:8])


def _device_allocs() -> tuple[int, int]:
    """The caching allocator's cudaMalloc and cudaFree calls so far (0, 0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0, 0
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("num_device_free", 0)


@attrs.define
class HostProbe:
    """Per-pass host figures: ``start()`` before a pass, ``stop()`` after it (after the device
    synchronized); ``summary()`` over the passes. Registers a ``gc`` callback while it lives
    (``close()`` removes it)."""

    launching_cpu: list[float] = attrs.Factory(list)
    others: dict[str, float] = attrs.Factory(dict)  # CPU seconds over all passes, by thread name
    gc_count: int = 0
    gc_seconds: float = 0.0
    allocs: int = 0
    frees: int = 0
    steal: int = 0
    ticks: int = 0
    _gc_t0: float | None = None
    _timing: bool = False
    _start: tuple | None = None

    def __attrs_post_init__(self) -> None:
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if not self._timing:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gc_count += 1
            self.gc_seconds += time.perf_counter() - self._gc_t0
            self._gc_t0 = None

    def start(self) -> None:
        self._start = (thread_cpu(), time.thread_time(), _device_allocs(), _steal())
        self._timing = True

    def stop(self) -> None:
        cpu_after, steal_after = time.thread_time(), _steal()
        allocs_after, threads_after = _device_allocs(), thread_cpu()
        self._timing = False
        threads0, cpu0, (allocs0, frees0), steal0 = self._start
        self.launching_cpu.append(cpu_after - cpu0)
        for name, t in other_threads_cpu(threads0, threads_after, threading.get_native_id()).items():
            self.others[name] = self.others.get(name, 0.0) + t
        self.allocs += allocs_after[0] - allocs0
        self.frees += allocs_after[1] - frees0
        if steal0 and steal_after:
            self.steal += steal_after[0] - steal0[0]
            self.ticks += steal_after[1] - steal0[1]

    def summary(self) -> dict:
        """A pass's mean figures (the launching thread's: the median)."""
        n = max(1, len(self.launching_cpu))
        return {"launching_cpu_s": statistics.median(self.launching_cpu) if self.launching_cpu else 0.0,
                "other_threads_cpu_s": {k: v / n for k, v in sorted(self.others.items(), key=lambda kv: -kv[1])},
                "gc_collections": self.gc_count / n, "gc_s": self.gc_seconds / n,
                "device_allocs": self.allocs / n, "device_frees": self.frees / n,
                "steal_fraction": self.steal / self.ticks if self.ticks else None}


def describe(summary: dict) -> str:
    """One line: the launching thread's CPU, the busiest other threads, GC, the allocator, steal."""
    others = list(summary["other_threads_cpu_s"].items())
    busy = ", ".join(f"{n} {t * 1e3:.0f}" for n, t in others[:3])
    steal = summary["steal_fraction"]
    return (f"launching thread's CPU {summary['launching_cpu_s'] * 1e3:.0f} ms, other threads "
            f"{sum(t for _, t in others) * 1e3:.0f} ms{f' ({busy})' if busy else ''}, "
            f"GC {summary['gc_collections']:.1f} collections {summary['gc_s'] * 1e3:.1f} ms, "
            f"cudaMalloc/cudaFree {summary['device_allocs']:.1f}/{summary['device_frees']:.1f}"
            + (f", steal {steal * 100:.1f}% of the machine's CPU" if steal is not None else ""))
