"""``examples/grpo_on_policy.py``: on the invariant kernels (Triton's interpreter here) every round's
trainer logprobs are the rollout's bitwise (``strict``: the parity gate is on) while transformers'
forward as the trainer is off; on the CPU embedded default (reference backend) it runs as the
README says."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from helpers import tiny_config
from triton_anywhere import RERUN_GRAPHS, TritonAnywhere

from bi_core import EngineConfig
from bi_core.plugins import load_registry

EXAMPLE = Path(__file__).parents[2] / "examples" / "grpo_on_policy.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_on_policy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.usefixtures("ordered_dot")
def test_grpo_rounds_are_on_policy_on_the_invariant_kernels(device):
    config = EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": "tiny-moe", "seed": 0}, "device": device.type, "max_model_len": 128},
        backend="triton_anywhere", graph=RERUN_GRAPHS,
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": 16}))
    rows = _example().grpo(config, rounds=2, num_prompts=2, n=2, max_new_tokens=5, lr=1e-2, strict=True,
                           registry=load_registry(extra_plugins=(TritonAnywhere(),)))
    assert [r["gap"] for r in rows] == [0.0, 0.0] and [r["max_ratio_gap"] for r in rows] == [0.0, 0.0]
    assert all(r["transformers_gap"] > 0 for r in rows)


def test_the_example_runs_on_the_embedded_default(capsys):
    assert _example().main(["--config", str(EXAMPLE.parents[1] / "configs" / "cpu_reference.yaml"), "--rounds", "1",
                            "--prompts", "2", "--n", "2", "--max-new-tokens", "4"]) == 0
    assert "round 0: max|train - rollout|" in capsys.readouterr().out


def test_the_example_trains_a_lora_adapter(capsys):
    """``--lora-rank``: rollouts on the adapter's version v, a step on A and B, the adapter synced."""
    module = _example()
    config = EngineConfig.from_yaml(EXAMPLE.parents[1] / "configs" / "cpu_reference.yaml")
    rows = module.grpo(config, rounds=2, num_prompts=2, n=2, max_new_tokens=4, lr=1e-2, lora_rank=4)
    assert len(rows) == 2 and "transformers_gap" not in rows[0]
    assert all(r["gap"] < 1e-4 for r in rows)  # the reference backend: close; round 1 on the synced version 2
    assert "round 1: max|train - rollout|" in capsys.readouterr().out
