"""The bench's own checks, on the CPU reference engine: a decode figure only when every timed step
ran all B rows past their prompts; a prefill figure only for fresh prompts, above its FLOP floor."""

from __future__ import annotations

import pytest
from helpers import tiny_config

from bi_core import EngineConfig, build_engine
from bi_core.tools.bench import BenchError, _prompts, bench_prefill, prefill_flops, time_decode_steps
from bi_core.tools.host_probe import describe


def engine(**scheduler):
    return build_engine(EngineConfig.from_dict(tiny_config(scheduler=scheduler)))


def test_decode_timing_checks_every_row_ran_in_every_step():
    eng = engine(max_num_seqs=8)
    ms, _ = time_decode_steps(eng, _prompts(eng, 6, 40, 0), steps=5)
    assert ms > 0 and not eng.scheduler.has_work()  # the rows are aborted after timing


def test_decode_timing_refuses_a_batch_that_did_not_all_decode():
    """Negative control: with room for 4 sequences, 6 prompts never decode together; before, this
    printed a figure for "B=6" that timed steps of the last 2 rows (the first 4 had finished)."""
    eng = engine(max_num_seqs=4)
    with pytest.raises(BenchError, match=r"did not all decode the 6 rows: 5 model batches of \[2\] rows"):
        time_decode_steps(eng, _prompts(eng, 6, 40, 0), steps=5)


def test_decode_timing_refuses_a_context_without_room_for_the_steps():
    eng = engine()
    with pytest.raises(BenchError, match="raise max_model_len or lower the context"):
        time_decode_steps(eng, _prompts(eng, 1, 500, 0), steps=20)


def test_prefill_is_timed_on_fresh_prompts_and_checked_against_its_floor():
    eng = engine()
    r = bench_prefill(eng, 2, 64, matmul_flops=1e15)  # a far faster "device": the floor is tiny
    assert r["cached_tokens"] == 0 and r["prefix_cache"] and eng.cache.prefix.stats()["hit_tokens"] == 0
    assert r["over_floor"] > 1 and len(r["pass_seconds"]) == 3  # each pass on its own fresh prompts (no hit: above)
    assert r["kernel_seconds"] is None  # no device for the profiler to time here
    # the CPU engine computes on the launching thread (and torch's others): a share of the pass, never more
    assert 0.1 * r["seconds"] < r["host"]["launching_cpu_s"] <= max(r["pass_seconds"]) * 1.05
    assert r["host"]["device_allocs"] == 0 and "GC" in describe(r["host"])
    with pytest.raises(BenchError, match="below its FLOP floor"):
        bench_prefill(eng, 2, 64, matmul_flops=1.0)  # one FLOP a second: no real run beats that floor
    assert prefill_flops(eng, [64]) > 2 * 64 * sum(p.numel() for n, p in eng.model.named_parameters()
                                                   if n.startswith("layers.") and p.dim() == 2)


def test_host_profile_covers_the_prefill_passes(monkeypatch, capsys):
    """BI_BENCH_PROFILE_HOST=N profiles the timed prefill passes too (the prefill's wall time varied
    1.1-2x over the same kernels, benchmarks sections 40-41), and only when asked."""
    eng = engine()
    bench_prefill(eng, 2, 64, matmul_flops=1e15)
    assert "host profile" not in capsys.readouterr().out
    monkeypatch.setenv("BI_BENCH_PROFILE_HOST", "5")
    bench_prefill(eng, 2, 64, matmul_flops=1e15, seed=50)
    out = capsys.readouterr().out
    assert "prefill 2 x 64: host profile of 3 timed passes" in out and "tottime" in out


def test_a_step_well_over_its_kernels_time_is_flagged_host_bound():
    """Section 37: graphed FP8 steps took 28.3 ms over 14.7 ms of kernels (a slow eviction on the
    host), and the bench printed the figure as if it were the device's."""
    from bi_core.tools.bench import HOST_BOUND_RATIO, host_bound_note

    assert host_bound_note(28.3, 14.7).startswith("  HOST-BOUND? 1.93x its kernels' 14.70 ms")
    assert host_bound_note(15.2, 14.7) == "" and host_bound_note(HOST_BOUND_RATIO * 10, 10.0) == ""
    assert host_bound_note(28.3, None) == ""  # kernels not counted (tensor parallel)


def test_comparisons_name_what_differs_and_give_the_prefill_device_time(capsys):
    """Two runs of one model that differ only in quantization and KV dtype get different labels,
    and the comparison gives the prefill's median pass ratio beside its device-time ratio (only
    where both runs timed their kernels, only between prefills of one shape)."""
    from bi_core.tools.bench_report import _label, print_comparisons

    bf16 = _label(EngineConfig.from_dict(tiny_config()))
    fp8 = _label(EngineConfig.from_dict(tiny_config(model={"quantization": "fp8"}, cache={"kv_cache_dtype": "fp8"})))
    assert fp8 == bf16 + " quantization=fp8 kv=fp8"
    decode = lambda ms: [{"batch": 1, "context_len": 512, "ms_per_step": ms}]
    prefill = lambda s, k, length=2048: {"batch": 8, "length": length, "seconds": s, "kernel_seconds": k}
    print_comparisons([{"label": fp8, "decode": decode(2.0), "prefill": prefill(0.3, 0.24)},
                       {"label": bf16, "decode": decode(3.0), "prefill": prefill(0.27, 0.26)},
                       {"label": "no kernels", "decode": decode(2.0), "prefill": prefill(0.6, None)},
                       {"label": "other shape", "decode": decode(2.0), "prefill": prefill(0.6, 0.5, 512)}])
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [f"== {bf16} vs {fp8}", "  decode B=1    ctx 512   1.500x time",
                       "  prefill 8 x 2048 0.900x time (median pass), 1.083x device time"]
    assert "  prefill 8 x 2048 2.000x time (median pass)" in out
    assert sum("prefill" in line for line in out) == 2  # none for the other shape
