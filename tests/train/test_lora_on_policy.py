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
from bi_core.lora.peft import adapter_from_tensors, read_adapter
from bi_core.lora.synthetic import random_adapter
from bi_core.plugins import load_registry
from bi_core.train import OnPolicyMismatch, PolicyModel, check_on_policy, policy_loss, rollout_logprobs

pytestmark = pytest.mark.usefixtures("ordered_dot")

CHUNK = 8


def _config(device, preset: str) -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": preset, "seed": 3}, "device": device.type, "max_model_len": 64},
        backend="triton_anywhere", graph=RERUN_GRAPHS, lora={"max_loras": 2, "max_rank": 8},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": CHUNK}))


PROMPTS = [[(5 * j + 3) % 250 for j in range(n)] for n in (5, 9)]  # 9: a chunk and a one-token last chunk


def _rollout(engine, lora: str):
    """Three sequences on the adapter (n=2 seeded T=1, greedy), then one without it."""
    params = [SamplingParams(max_new_tokens=3, temperature=1.0, seed=11, n=2, ignore_eos=True, lora_name=lora),
              SamplingParams(max_new_tokens=3, ignore_eos=True, lora_name=lora),
              SamplingParams(max_new_tokens=3, temperature=1.0, seed=14, ignore_eos=True)]
    prompts = PROMPTS + PROMPTS[:1]
    outs = engine.generate(prompts, params)
    ps, cs = zip(*[(p, s.token_ids) for p, o in zip(prompts, outs) for s in o.outputs])
    return list(ps), list(cs), rollout_logprobs(outs)


def _engine_on_adapter(device, preset: str, registry, quantization: str | None = None):
    config = _config(device, preset)
    if quantization:
        config = config.replace(model={"quantization": quantization})
    engine = build_engine(config, registry)
    cfg, tensors = random_adapter(engine, r=4, seed=5, scale=2.0)
    engine.load_lora_adapter("policy", tensors=tensors, config=cfg)
    return config, engine, cfg, tensors


def test_lora_trainer_is_on_policy_before_and_after_an_adapter_sync(device, tmp_path):
    """Dense (the MLP's gate|up without the fused SiLU epilogue when LoRA is on, GDN and attention
    projections): bitwise in two micro-batchings; the trainer without an adapter bitwise on the
    engine's request without one; a GRPO step on A and B; the adapter saved as PEFT's files and
    loaded as version 2; that version's rollout bitwise again."""
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    config, engine, cfg, tensors = _engine_on_adapter(device, "tiny-dense", registry)
    ps, cs, want = _rollout(engine, "policy")
    (ps, base_p), (cs, base_c), (want, base_want) = ((x[:3], x[3:]) for x in (ps, cs, want))
    policy = PolicyModel.from_config(config, registry, lora=cfg, lora_tensors=tensors)
    lps = policy.token_logprobs(ps, cs)
    check_on_policy(want, lps)
    split = policy.token_logprobs(ps[2:], cs[2:]) + policy.token_logprobs(ps[:2], cs[:2])  # another micro-batching
    check_on_policy(want, split[1:] + split[:1])
    base = PolicyModel.from_config(config, registry)  # the LoRA-on config without an adapter
    check_on_policy(base_want, base.token_logprobs(base_p, base_c))
    with pytest.raises(OnPolicyMismatch):  # negative controls: each trainer on the other's rows
        check_on_policy(want[:1], base.token_logprobs(ps[:1], cs[:1]))
    with pytest.raises(OnPolicyMismatch):
        check_on_policy(base_want, policy.token_logprobs(base_p, base_c))
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=0.05)
    loss, stats = policy_loss(lps, want, torch.tensor([1.0, -1.0, 0.5]))
    assert stats.max_ratio_gap == 0.0
    loss.backward()
    assert all((p.grad is not None) == n.endswith(("lora_A.weight", "lora_B.weight"))
               for n, p in policy.named_parameters())  # the base weights are frozen
    opt.step()
    path = policy.save_adapter(tmp_path / "v2")
    from_disk = read_adapter(path)
    for name, (a, b) in adapter_from_tensors(policy.adapter_config(), policy.adapter_tensors(), "tensors").modules.items():
        assert torch.equal(from_disk.modules[name][0], a) and torch.equal(from_disk.modules[name][1], b)
    assert engine.load_lora_adapter("policy", path).version == 2
    outs = engine.generate(PROMPTS, [SamplingParams(max_new_tokens=3, temperature=1.0, seed=12, ignore_eos=True,
                                                    lora_name="policy")] * 2)
    cs, want = [o.token_ids for o in outs], rollout_logprobs(outs)
    check_on_policy(want, policy.token_logprobs(PROMPTS, cs))
    old = PolicyModel.from_config(config, registry, lora=cfg, lora_tensors=tensors)
    with pytest.raises(OnPolicyMismatch):  # negative control: the trainer on version 1
        check_on_policy(want, old.token_logprobs(PROMPTS, cs))


@pytest.mark.parametrize("preset,quantization", [("tiny-moe", None), ("tiny-moe-b128", "fp8")])
def test_moe_lora_trainer_is_on_policy(device, preset, quantization):
    """MoE: the router's and the shared-expert gate's adapters too (they move the routing); block
    FP8 base weights: the delta after the FP8 GEMM, GDN's in_proj and in_proj_ba writing their
    columns of one buffer."""
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    config, engine, cfg, tensors = _engine_on_adapter(device, preset, registry, quantization)
    assert any("mlp.gate." in k for k in tensors)
    outs = engine.generate(PROMPTS[1:], [SamplingParams(max_new_tokens=3, temperature=1.0, seed=13, ignore_eos=True,
                                                         lora_name="policy")])
    cs, want = [outs[0].token_ids], rollout_logprobs(outs)
    policy = PolicyModel.from_config(config, registry, lora=cfg, lora_tensors=tensors)
    check_on_policy(want, policy.token_logprobs(PROMPTS[1:], cs))
    loaded = engine.load_lora_adapter("policy", tensors=policy.adapter_tensors(), config=policy.adapter_config())
    assert loaded.version == 2  # (the same tensors: a sync by tensors the engine takes)
    with pytest.raises(OnPolicyMismatch):
        check_on_policy(want, PolicyModel.from_config(config, registry).token_logprobs(PROMPTS[1:], cs))


def _without_experts(cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The adapter without its expert parts (the routed experts' parameters, the shared expert)."""
    keep = {k: v for k, v in tensors.items() if ".mlp.experts" not in k and ".shared_expert." not in k}
    return {k: v for k, v in cfg.items() if k != "target_parameters"}, keep


def test_expert_lora_trainer_is_on_policy_before_and_after_a_step(device):
    """lora.experts: adapters on the routed experts' fused parameters (PEFT's target_parameters)
    and the shared expert too: bitwise the rollout's logprobs; a step on every A and B (the
    experts' included), the adapter synced by tensors as version 2, bitwise again. Negative
    controls: the trainer without the adapter's expert parts, and on version 1 against version 2."""
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    config = _config(device, "tiny-moe").replace(lora={"experts": True})
    engine = build_engine(config, registry)
    cfg, tensors = random_adapter(engine, r=4, seed=5, scale=2.0)
    assert cfg["target_parameters"] and any(".shared_expert." in k for k in tensors)
    engine.load_lora_adapter("policy", tensors=tensors, config=cfg)
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=13, ignore_eos=True, lora_name="policy")
    outs = engine.generate(PROMPTS, [params] * 2)
    cs, want = [o.token_ids for o in outs], rollout_logprobs(outs)
    policy = PolicyModel.from_config(config, registry, lora=cfg, lora_tensors=tensors)
    lps = policy.token_logprobs(PROMPTS, cs)
    assert all(torch.equal(torch.tensor(w), lp.detach()) for w, lp in zip(want, lps))  # bitwise
    partial = PolicyModel.from_config(config, registry, lora=_without_experts(cfg, tensors)[0],
                                      lora_tensors=_without_experts(cfg, tensors)[1])
    with pytest.raises(OnPolicyMismatch):
        check_on_policy(want, partial.token_logprobs(PROMPTS, cs))
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=0.05)
    loss, _ = policy_loss(lps, want, torch.tensor([1.0, -1.0]))
    loss.backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    assert any(".mlp.experts.base_layer.lora_B" in n for n in grads)
    assert all(g is not None and torch.count_nonzero(g) > 0 for n, g in grads.items() if "mlp.experts" in n)
    opt.step()
    loaded = engine.load_lora_adapter("policy", tensors=policy.adapter_tensors(), config=policy.adapter_config())
    assert loaded.version == 2
    params = SamplingParams(max_new_tokens=3, temperature=1.0, seed=12, ignore_eos=True, lora_name="policy")
    outs = engine.generate(PROMPTS, [params] * 2)
    cs, want = [o.token_ids for o in outs], rollout_logprobs(outs)
    check_on_policy(want, policy.token_logprobs(PROMPTS, cs))  # bitwise
    old = PolicyModel.from_config(config, registry, lora=cfg, lora_tensors=tensors)
    with pytest.raises(OnPolicyMismatch):  # negative control: the trainer on version 1
        check_on_policy(want, old.token_logprobs(PROMPTS, cs))
