"""benchmarks/kernels/fp8_kernel_bench.py's --cold rotation: enough weight copies that a call finds none of
its weights in the L2 (the GPU timing itself runs on the device only)."""

from __future__ import annotations

from helpers import benchmark_module


def test_cold_copies_hold_three_times_the_l2():
    bench = benchmark_module("fp8_kernel_bench")
    l2 = 50 << 20  # an H100's / H200's
    assert bench.cold_copies(25 << 20, l2) == 6  # 12352 x 2048 FP8 weights: six copies, 150 MiB
    assert bench.cold_copies(1 << 20, l2) == 150  # 2048 x 512: a call each, 150 calls a graph
    assert bench.cold_copies(200 << 20, l2) == 2  # larger than the L2: still two, never the same twice
    assert bench.cold_copies(26 << 20, l2) * (26 << 20) >= 3 * l2


def test_without_cold_one_copy_and_each_binds_it():
    bench = benchmark_module("fp8_kernel_bench")
    assert not bench.COLD
    w = object()
    assert bench.rotations(w) == [(w,)]
    calls = bench.each([(1, 2), (3, 4)], lambda a, b, c, scale=1: (a, b, c, scale), "x", scale=5)
    assert [c() for c in calls] == [("x", 1, 2, 5), ("x", 3, 4, 5)]
