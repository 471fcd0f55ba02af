"""benchmarks/structured_bench.py end to end on a tiny model on the CPU (``--smoke``: its figures
come from GPU runs): it prints the table and one JSON line per batch size, and it fails loudly
when a constrained row was not masked on the device (negative control: the AR strategy's device
masks turned off, so the constrained rows take the row-by-row sampler)."""

from __future__ import annotations

import json

import pytest
from helpers import benchmark_module

from bi_core.strategies.ar import ARStrategy
from bi_core.tools.bench import BenchError


def test_the_structured_bench_runs_and_checks_what_it_measures(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert benchmark_module("structured_bench").main(["--smoke", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["plain_ms"] > 0 and r["json_ms"] > 0 for r in rows)
    assert all(len(r["runs_ms"]["json"]) == 2 for r in rows)
    printed = capsys.readouterr().out
    assert "| reference | 2 |" in printed and printed.count('{"backend": "reference"') == 2


def test_the_structured_bench_fails_when_rows_are_not_masked_on_the_device(monkeypatch):
    monkeypatch.setattr(ARStrategy, "masks_device_samples", False)
    with pytest.raises(BenchError, match="constrained rows were masked on the device"):
        benchmark_module("structured_bench").main(["--smoke"])
