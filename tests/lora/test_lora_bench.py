"""benchmarks/lora_bench.py runs end to end on a tiny CPU model (its figures come from GPU runs)."""

from __future__ import annotations

import json

from helpers import benchmark_module


def test_lora_bench_smoke(tmp_path):
    out = tmp_path / "lora.json"
    assert benchmark_module("lora_bench").main(["--smoke", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["decode_ms"]) == {f"B={b} {what}" for b in (1, 2) for what in
                                        ("base (lora off)", "lora on, no adapter", "rank 4, 2 adapters",
                                         "rank 8, 2 adapters")}
    assert all(ms > 0 for ms in report["decode_ms"].values())
    s = report["sync"]
    assert s["adapter_s"] > 0 and s["full_weights_s"] > 0 and 0 < s["adapter_bytes"] < s["full_bytes"]
