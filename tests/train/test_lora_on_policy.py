"""The LoRA trainer on the invariant backend's Triton kernels (CPU: Triton's interpreter with
``ordered_dot``): a ``PolicyModel`` carrying the adapter a LoRA-on engine serves gives every token
the engine sampled on that adapter its rollout logprob, bitwise, in any micro-batching; after a
train step and an adapter-only sync (tensors, or PEFT's files on disk) as the name's next version,
again. Negative controls: the trainer without the adapter, and the trainer on the old version
against the new version's rollout, must differ."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from triton_anywhere import RERUN_GRAPHS, TritonAnywhere

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.lora.synthetic import random_adapter
from bi_core.plugins import load_registry
from bi_core.train import OnPolicyMismatch, PolicyModel, check_on_policy, policy_loss, rollout_logprobs

pytestmark = pytest.mark.usefixtures("ordered_dot")

CHUNK = 16


def _config(device, preset: str) -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": preset, "seed": 3}, "device": device.type, "max_model_len": 64},
        backend="triton_anywhere", graph=RERUN_GRAPHS, lora={"max_loras": 2, "max_rank": 8},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": CHUNK}))


PROMPTS = [[(5 * j + 3) % 250 for j in range(n)] for n in (7, 17)]  # 17: a chunk and a one-token last chunk


def _rollout(engine, lora: str | None, seed: int = 11):
    params = [SamplingParams(max_new_tokens=4, temperature=1.0, seed=seed, n=2, ignore_eos=True, lora_name=lora),
              SamplingParams(max_new_tokens=3, ignore_eos=True, lora_name=lora)]
    outs = engine.generate(PROMPTS, params)
    ps, cs = zip(*[(p, s.token_ids) for p, o in zip(PROMPTS, outs) for s in o.outputs])
    return list(ps), list(cs), rollout_logprobs(outs)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_lora_trainer_is_on_policy_before_and_after_an_adapter_sync(device, preset, tmp_path):
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    config = _config(device, preset)
    engine = build_engine(config, registry)
    cfg, tensors = random_adapter(engine, r=4, seed=5, scale=2.0)
    engine.load_lora_adapter("policy", tensors=tensors, config=cfg)
    ps, cs, want = _rollout(engine, "policy")
    policy = PolicyModel.from_config(config, registry, lora=cfg, lora_tensors=tensors)
    lps = policy.token_logprobs(ps, cs)
    check_on_policy(want, lps)
    check_on_policy(want, _one_by_one(policy, ps, cs))  # another micro-batching: each sequence alone
    with pytest.raises(OnPolicyMismatch):  # negative control: the same trainer without the adapter
        check_on_policy(want, PolicyModel.from_config(config, registry).token_logprobs(ps, cs))
    # one GRPO step on A and B only, then the adapter alone to the engine, as the name's next version
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=0.05)
    loss, stats = policy_loss(lps, want, torch.tensor([1.0, -1.0, 0.5]))
    assert stats.max_ratio_gap == 0.0
    loss.backward()
    frozen = [n for n, p in policy.named_parameters() if not n.endswith(("lora_A.weight", "lora_B.weight"))]
    assert frozen and all(p.grad is None for n, p in policy.named_parameters() if n in frozen)
    opt.step()
    if preset == "tiny-dense":
        loaded = engine.load_lora_adapter("policy", policy.save_adapter(tmp_path / "v2"))  # PEFT's files
    else:
        loaded = engine.load_lora_adapter("policy", tensors=policy.adapter_tensors(), config=policy.adapter_config())
    assert loaded.version == 2
    ps, cs, want = _rollout(engine, "policy", seed=12)
    check_on_policy(want, policy.token_logprobs(ps, cs))
    old = PolicyModel.from_config(config, registry, lora=cfg, lora_tensors=tensors)
    with pytest.raises(OnPolicyMismatch):  # negative control: the trainer on version 1
        check_on_policy(want, old.token_logprobs(ps, cs))


def _one_by_one(policy, ps, cs):
    return [policy.token_logprobs([p], [c])[0] for p, c in zip(ps, cs)]
