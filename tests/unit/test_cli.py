"""The CLI: run (text and JSON), explain, plugins; errors are one line, exit code 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = str(Path(__file__).parents[2] / "configs" / "cpu_reference.yaml")


def cli(*args, env=None):
    import os

    e = {**os.environ, **(env or {})}
    e.pop("BI_ENABLE_BATCH_INVARIANT", None) if not env else None
    return subprocess.run([sys.executable, "-m", "bi_core.cli", *args], capture_output=True, text=True, env=e)


def test_run_default_command_json():
    r = cli("--config", CONFIG, "--json", "--max-new-tokens", "5", "--prompt-ids", "1,2,3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out) == 1 and len(out[0]["token_ids"]) == 5 and out[0]["finish_reason"] == "length"
    assert len(out[0]["logprobs"]) == 5


def test_run_text_output():
    r = cli("run", "--config", CONFIG, "--max-new-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("(length, 3 tokens)") == 3


def test_explain_and_plugins():
    r = cli("explain", "--config", CONFIG)
    assert r.returncode == 0 and "attention     -> reference" in r.stdout
    r = cli("plugins")
    assert r.returncode == 0 and "reference" in r.stdout and "ar" in r.stdout


def test_errors_are_one_line_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {random: {preset: tiny-dense}}\nscheduler: {max_num_seqs: -3}\n")
    r = cli("--config", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "bi-engine: error: scheduler.max_num_seqs: expected a positive int, got -3"
    r = cli("--config", CONFIG, "--batch-invariant")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "backend: 'reference' contradicts batch-invariant mode" in r.stderr
    r = cli("--config", CONFIG, "--prompt-ids", "1,x")
    assert r.returncode == 2 and "--prompt-ids[0]: expected comma-separated integers" in r.stderr


def test_bench_and_verify_errors_are_clear(tmp_path):
    import torch

    if not torch.cuda.is_available():
        r = cli("bench", "--config", CONFIG, "--prefill", "none", "--throughput", "none")
        assert r.returncode == 2 and "bench needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr
    r = cli("verify", "--config", CONFIG, "--strategies", "mtp,ar")
    assert r.returncode == 2 and "--strategies: expected 'ar' or 'ar,mtp'" in r.stderr
    r = cli("verify", "--config", CONFIG, "--batch-sizes", "1,x")
    assert r.returncode == 2 and "--batch-sizes: expected comma-separated positive integers" in r.stderr


@pytest.mark.parametrize("flag,value,message", [
    ("--steps", "0", "--steps: expected a positive integer, got 0"),
    ("--batch-sizes", "1,x", "--batch-sizes: expected comma-separated positive integers, got '1,x'"),
    ("--context-len", "0", "--context-len: expected comma-separated positive integers"),
    ("--prefill", "8x0", "--prefill: every part must be positive"),
])
def test_bench_flags_are_checked_before_anything_runs(flag, value, message):
    """One line naming the flag, on any machine (these were a ZeroDivisionError / ValueError traceback)."""
    r = cli("bench", "--config", CONFIG, flag, value)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_verify_exit_codes_on_the_reference_backend():
    """The reference backend is not invariant: verify fails (1); its negative control passes (0)."""
    args = ("verify", "--config", CONFIG, "--num-prompts", "2", "--batch-sizes", "1,6", "--max-new-tokens", "4",
            "--modes", "greedy")
    r = cli(*args)
    assert r.returncode == 1 and "FAIL: outputs depend on the batch" in r.stdout
    r = cli(*args, "--negative-control")
    assert r.returncode == 0 and "negative control PASSED" in r.stdout


def test_verify_refuses_an_audit_that_would_run_less_than_asked(capsys):
    """A batch size above scheduler.max_num_seqs, an unknown mode, no prompts, no tokens: exit 2
    with the reason, before any engine is built (never a skip and a PASS)."""
    from bi_core.cli import main

    base = ["verify", "--config", CONFIG, "--num-prompts", "2", "--max-new-tokens", "2", "--modes", "greedy"]
    cases = {
        ("--batch-sizes", "1,64"): "--batch-sizes: the audit cannot run batch sizes above scheduler.max_num_seqs=16 "
                                   "(got 64)",
        ("--batch-sizes", "0"): "--batch-sizes: expected comma-separated positive integers, got '0'",
        ("--modes", "gredy"): "--modes: expected greedy and/or sampled, got 'gredy'",
        ("--modes", "greedy,foo"): "--modes: expected greedy and/or sampled, got 'foo'",
        ("--num-prompts", "0"): "--num-prompts: expected a positive number of prompts, got 0",
        ("--max-new-tokens", "0"): "--max-new-tokens: expected a positive int, got 0",
    }
    for extra, message in cases.items():
        assert main([*base, *extra]) == 2, extra
        captured = capsys.readouterr()
        assert f"bi-engine: error: {message}" in captured.err and "PASS" not in captured.out, extra


def test_unknown_subcommand_is_named(capsys):
    from bi_core.cli import main

    assert main(["foo"]) == 2
    assert capsys.readouterr().err.strip() == ("bi-engine: error: 'foo' is not a command; expected one of run, "
                                               "explain, plugins, verify, bench, serve, draft-vocab (or run's options, e.g. "
                                               "bi-engine --config FILE)")


def test_config_file_problems_are_one_line(tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x89PNG\x00\xff\xfe")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  random: {preset: tiny-dense\nbackend: reference\n")
    for path, message in ((binary, "is not UTF-8 text"), (tmp_path, "is a directory"),
                          (bad, "is not valid YAML: line 3, column 8: ")):
        r = cli("--config", str(path))
        assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert message in r.stderr


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "inf"], "argument --temperature: expected a finite number in [0.0, 100.0], got inf"),
    (["--temperature", "nan"], "argument --temperature: expected a finite number in [0.0, 100.0], got nan"),
    (["--temperature", "1e999"], "argument --temperature: expected a finite number in [0.0, 100.0], got inf"),
    (["--seed", str(2 ** 70)], f"argument --seed: expected a seed in [0, 2**64 - 1] (random draws are keyed by 64 "
                               f"bits), got {2 ** 70}"),
    (["--seed", "-1"], "argument --seed: expected an int >= 0, got -1"),
    (["--logprobs", "21"], "argument --logprobs: expected an int <= 20, got 21"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive int, got 0"),
])
def test_run_flags_take_what_the_config_keys_take(flags, message, capsys):
    """Each flag is checked by its config key's own parser as it is parsed: exit 2 naming the flag,
    before any engine is built (inf and 2**70 used to be taken and sampled with)."""
    from bi_core.cli import main

    assert main(["run", "--config", CONFIG, "--prompt-ids", "1,2", *flags]) == 2
    err = capsys.readouterr().err
    assert f"bi-engine run: error: {message}\n" in err and "Traceback" not in err, err


def test_the_largest_seed_flag_is_taken(capsys):
    from bi_core.cli import main

    assert main(["run", "--config", CONFIG, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--temperature", "1",
                 "--seed", str(2 ** 64 - 1), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)[0]["token_ids"]) == 1


@pytest.mark.parametrize("ids,item", [("1,,2", "item 2 is empty"), ("1,2,", "item 3 is empty"),
                                      ("1,-3", "item 2 is '-3'"), ("", "item 1 is empty")])
def test_prompt_ids_with_a_hole_are_refused(ids, item, capsys):
    """'1,,2' was read as [1, 2]: an empty item is more likely a lost id than nothing."""
    from bi_core.cli import main

    assert main(["run", "--config", CONFIG, "--prompt-ids", ids]) == 2
    assert capsys.readouterr().err == (f"bi-engine: error: --prompt-ids[0]: expected comma-separated integers >= 0 "
                                       f"(token ids), got {ids!r} ({item})\n")


def test_explain_with_an_unknown_backend_is_an_error_listing_the_known_ones(tmp_path, capsys):
    from bi_core.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("model: {random: {preset: tiny-dense}, device: cpu}\nbackend: refrence\n")
    assert main(["explain", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("bi-engine: error: backend: unknown backend 'refrence'; registered: ") and \
        "cuda_default" in captured.err and "reference" in captured.err and captured.err.endswith(" (or auto)\n")
    assert captured.out == ""


def test_a_nan_config_value_is_one_line_naming_the_key(tmp_path, capsys):
    from bi_core.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(Path(CONFIG).read_text() + "serve: {shutdown_timeout_s: .nan}\n")
    assert main(["explain", "--config", str(path)]) == 2
    assert capsys.readouterr().err == ("bi-engine: error: serve.shutdown_timeout_s: expected a finite number in "
                                       "[0.0, 3600.0], got nan\n")


def test_draft_vocab_out_must_be_a_file_in_a_directory_that_exists(tmp_path, capsys):
    """Both were an OSError traceback after counting the whole corpus; now refused before counting."""
    from bi_core.cli import main

    text = tmp_path / "a.txt"
    text.write_text("hello")
    for out, message in ((tmp_path / "missing" / "t.json", f"--out: directory {tmp_path / 'missing'} does not exist"),
                         (tmp_path, f"--out: {tmp_path} is a directory; name the file to write")):
        assert main(["draft-vocab", "--config", CONFIG, "--out", str(out), str(text)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"bi-engine: error: {message}") and len(err.splitlines()) == 1, err


def test_draft_vocab_jsonl_rows_must_be_text(tmp_path, capsys):
    """A row that is neither a string nor an object with a string 'text' was counted as its JSON repr."""
    from bi_core.cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text('"fine"\n{"txt": "typo"}\n')
    assert main(["draft-vocab", "--config", CONFIG, "--out", str(tmp_path / "t.json"), str(corpus)]) == 2
    assert capsys.readouterr().err == (f"bi-engine: error: {corpus}:2: expected a JSON string or an object with a "
                                       "string 'text' field\n")


def test_a_binary_draft_vocab_file_is_one_line_naming_the_key(tmp_path, capsys):
    from bi_core.cli import main

    table = tmp_path / "weights.bin"
    table.write_bytes(b"\x00\x01\x02\xff\xfe" * 8)
    path = tmp_path / "c.yaml"
    path.write_text("model: {random: {preset: tiny-dense, seed: 0}, dtype: float32, device: cpu, max_model_len: 64}\n"
                    f"backend: reference\nstrategy: {{name: mtp, draft_vocab_size: 8, draft_vocab: '{table}'}}\n")
    assert main(["run", "--config", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err == (f"bi-engine: error: strategy.draft_vocab: {table} is not a text file (byte "
                                       "0xff at offset 3); expected token ids (a JSON list of ints, or ints separated "
                                       "by whitespace, e.g. what bi-engine draft-vocab writes)\n")
