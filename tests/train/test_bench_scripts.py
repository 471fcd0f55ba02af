"""The trainer's benchmark scripts run end to end on a tiny model (their figures come from GPU runs:
docs/performance.md). On the reference backend the audit must find mismatches (it is not
batch-invariant), which checks that it compares at all."""

from __future__ import annotations

import json

from helpers import benchmark_module


def test_train_parity_script(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text("model: {random: {preset: tiny-moe, seed: 0}, dtype: float32, device: cpu, max_model_len: 256}\n"
                      "backend: reference\n"
                      "scheduler: {max_num_seqs: 16, max_num_batched_tokens: 256, prefill_chunk_size: 32}\n"
                      "cache: {block_size: 16, num_blocks: 256}\n")
    out = tmp_path / "parity.json"
    code = benchmark_module("train_parity").main([str(config), "--layers", "2", "--prompts", "3", "--n", "2",
                                                  "--prompt-len", "40", "--new-tokens", "6", "--mtp", "2",
                                                  "--transformers", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    checks = {k: v for k, v in report.items() if isinstance(v, dict) and "mismatches" in v}
    assert len(checks) == 3 * 3 + 1  # AR, after a step, MTP: three micro-batchings each; the control
    assert report["AR rollout / in order, 8 a batch"]["tokens"] == 3 * 2 * 6
    assert code == 1 and sum(v["mismatches"] for v in checks.values()) > 0
