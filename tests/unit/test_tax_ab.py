"""dev/probes/tax_ab.py on the CPU: the bench processes are stand-ins writing reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import benchmark_module


@pytest.fixture(scope="module")
def tax_ab():
    return benchmark_module("tax_ab")


def _report(ms: float, tok_s: float) -> dict:
    return {"configs": [{"decode": [{"batch": 8, "context_len": 131000, "ms_per_step": ms}],
                         "throughput": {"output_tokens_per_s": tok_s}}]}


def test_alternates_processes_and_compares_medians_and_pairs(tax_ab, capsys):
    """A, B, A, B, A, B; B's time over A's from the medians and from each round's pair (a
    throughput's ratio inverted: more tokens/s is less time)."""
    a_ms, b_ms = [12.0, 12.6, 11.7], [12.5, 12.2, 12.3]
    a_tok, b_tok = [1000.0, 900.0, 950.0], [800.0, 950.0, 900.0]
    order = []

    def bench(config, bench_args, path):
        assert bench_args == ["--batch-sizes", "8"]
        i = sum(c == config for c in order)
        order.append(config)
        ms, tok = (a_ms[i], a_tok[i]) if config == "a.yaml" else (b_ms[i], b_tok[i])
        Path(path).write_text(json.dumps(_report(ms, tok)))

    rows = tax_ab.main(["--config", "a.yaml", "--config", "b.yaml", "--", "--batch-sizes", "8"], bench=bench)
    assert order == ["a.yaml", "b.yaml"] * 3
    decode, tput = rows
    assert decode["figure"] == "decode B=8 ctx 131000 ms/step"
    assert decode["medians"] == {"a.yaml": 12.0, "b.yaml": 12.3}
    assert decode["time_ratio_of_medians"] == pytest.approx(12.3 / 12.0)
    assert decode["time_ratio_pairs"] == pytest.approx([12.2 / 12.6, 12.3 / 11.7])
    assert tput["time_ratio_of_medians"] == pytest.approx(950.0 / 900.0)
    assert tput["time_ratio_pairs"] == pytest.approx([900.0 / 950.0, 1000.0 / 800.0])
    assert "time 1.025x (pairs 0.968-1.051x)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--config", "a.yaml"], "give two different configs"),
    (["--config", "a.yaml", "--config", "a.yaml"], "give two different configs"),
    (["--config", "a.yaml", "--config", "b.yaml", "--rounds", "0"], "--rounds: at least 1"),
    (["--config", "a.yaml", "--config", "b.yaml", "--", "--json", "x"], "other than --config and --json"),
])
def test_bad_arguments_get_one_clear_error(tax_ab, argv, message, capsys):
    with pytest.raises(SystemExit):
        tax_ab.main(argv, bench=lambda *a: pytest.fail("no bench may run"))
    assert message in capsys.readouterr().err


def test_a_failed_bench_names_its_config(tax_ab, monkeypatch):
    class Done:
        returncode, stdout, stderr = 2, "", "bi-engine: error: bench needs a CUDA GPU"

    monkeypatch.setattr(tax_ab.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(RuntimeError, match=r"bench of b.yaml failed \(exit 2\).*needs a CUDA GPU"):
        tax_ab.run_bench("b.yaml", [], "/tmp/x.json")
