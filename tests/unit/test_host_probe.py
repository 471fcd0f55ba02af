"""The prefill's host figures (tools/host_probe.py): each must see what it claims to see."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from bi_core.tools.host_probe import HostProbe, describe, other_threads_cpu, thread_cpu


def _busy(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


@pytest.mark.skipif(not thread_cpu(), reason="no /proc/self/task here")
def test_other_threads_cpu_sees_a_busy_thread_and_not_the_launching_one():
    """A thread spinning beside the launching one is counted; the launching thread (busy too) is
    not; a sleeping thread adds nothing."""
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    threads = [threading.Thread(target=spin), threading.Thread(target=stop.wait)]
    for t in threads:
        t.start()
    before = thread_cpu()
    _busy(0.6)  # the launching thread busy as well: it shares the GIL with spin
    after = thread_cpu()
    stop.set()
    for t in threads:
        t.join()
    me, spinner, sleeper = threading.get_native_id(), threads[0].native_id, threads[1].native_id
    spun = after[spinner][1] - before[spinner][1]
    assert spun > 0.05 and after[sleeper][1] - before[sleeper][1] < 0.05 and after[me][1] - before[me][1] > 0.05
    # (the process may hold other busy threads, from other tests: the spinner's name holds at least its CPU)
    assert other_threads_cpu(before, after, me)[after[spinner][0]] >= spun - 1e-9
    assert other_threads_cpu(before, {me: after[me]}, me) == {}  # the launching thread is never counted


def test_probe_counts_collections_in_a_pass_and_none_outside():
    probe = HostProbe()
    gc.disable()  # only the explicit collections below (no thread of the process collects on its own)
    try:
        gc.collect()  # outside a pass: not counted
        probe.start()
        gc.collect()
        gc.collect()
        _busy(0.05)
        probe.stop()
        gc.collect()
    finally:
        gc.enable()
        probe.close()
    s = probe.summary()
    assert s["gc_collections"] == 2 and s["gc_s"] > 0
    assert 0.03 < s["launching_cpu_s"] < 5 and s["device_allocs"] == 0
    assert probe._on_gc not in gc.callbacks  # closed: no callback left behind
    line = describe(s)
    assert f"GC {s['gc_collections']:.1f} collections" in line and "launching thread's CPU" in line
