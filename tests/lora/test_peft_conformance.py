"""The engine serving a PEFT adapter against PEFT on transformers' own Qwen3.5 (tiny random
checkpoints, float32, the reference backend): first-token logits close, the same greedy tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hf_fixtures import hf_greedy, make_hf_model, save_checkpoint  # noqa: E402
from lora_fixtures import engine_config, make_adapter  # noqa: E402

from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402

pytest.importorskip("peft")
STEPS = 8
PROMPTS = [[5, 17, 70, 1, 33, 2, 9], list(range(40, 110))]  # 70 tokens: past a 64-token GDN chunk


def first_logits_and_outputs(engine, params):
    first = {}

    def observe(seqs, logits):
        for s, row in zip(seqs, logits):
            if not s.output_ids:
                first[s.request_id] = row.float().clone()

    engine.on_logits = observe
    outs = engine.generate(PROMPTS, params)
    return outs, [first[o.request_id] for o in outs]


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind,rslora,rank_pattern", [
    ("dense", False, None), ("dense", True, {"o_proj": 4}), ("moe", False, None)])
def test_matches_peft(tmp_path, kind, rslora, rank_pattern):
    hf = make_hf_model(kind)
    ckpt = save_checkpoint(hf, tmp_path / "ckpt")
    targets = None if kind == "dense" else ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                            "out_proj", "shared_expert_gate"]
    peft_model = make_adapter(hf, tmp_path / "adapter", rslora=rslora, rank_pattern=rank_pattern, targets=targets)
    engine = build_engine(EngineConfig.from_dict(engine_config(ckpt, {"a": str(tmp_path / "adapter")})))
    params = SamplingParams(max_new_tokens=STEPS, ignore_eos=True, lora_name="a")
    outs, logits = first_logits_and_outputs(engine, params)
    base_outs, base_logits = first_logits_and_outputs(engine, SamplingParams(max_new_tokens=STEPS, ignore_eos=True))
    for prompt, out, ours, base in zip(PROMPTS, outs, logits, base_logits):
        tokens, _, first = hf_greedy(peft_model, prompt, STEPS)
        assert rel_err(ours, first) < 1e-4
        assert rel_err(base, first) > 1e-2  # the adapter changes the logits: the comparison can fail
        assert out.token_ids == tokens
    with peft_model.disable_adapter():  # the base rows are the base model's
        for prompt, base in zip(PROMPTS, base_logits):
            assert rel_err(base, hf_greedy(peft_model, prompt, 1)[2]) < 1e-4
