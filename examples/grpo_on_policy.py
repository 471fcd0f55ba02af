"""GRPO, truly on-policy, in one process: engine rollouts (n samples a prompt) -> the trainer's
logprobs of those completions -> one GRPO step -> weight sync -> the next round. Each round prints
``max |train - rollout|`` for ``bi_core.train.PolicyModel`` (0 on the invariant backend: the
trainer computes the rollout's bits) and for transformers' own Qwen3.5 forward as the trainer
(the gap RL stacks correct with importance sampling today).

    python examples/grpo_on_policy.py                                   # CPU, tiny random model
    python examples/grpo_on_policy.py --config configs/h100_invariant.yaml --rounds 5   # a GPU
    python examples/grpo_on_policy.py --lora-rank 8     # LoRA: rollouts on adapter v, train, sync v+1

With ``--lora-rank`` the trainer trains a LoRA adapter (every projection the engine adapts, base
weights frozen) and each round syncs the adapter alone, as the engine's next version of it.

On the CPU embedded default (the reference backend, which is not batch-invariant) both gaps are
small but not 0; on ``cuda_hopper_invariant`` the policy's is 0. The reward is a toy, checkable
one (the share of even token ids in a completion), so random weights have something to learn.
"""

from __future__ import annotations

import argparse

import attrs
import torch

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.train import PolicyModel, check_on_policy, group_advantages, max_gap, policy_loss
from bi_core.train.hf import to_transformers, transformers_logprobs


def reward(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / max(1, len(tokens))


def grpo(config: EngineConfig, *, rounds: int = 3, num_prompts: int = 4, n: int = 4, max_new_tokens: int = 16,
         lr: float = 1e-3, strict: bool = False, registry=None, compare_transformers: bool = True,
         lora_rank: int = 0) -> list[dict]:
    """The loop; returns one dict per round. ``strict``: stop (``OnPolicyMismatch``) at the first
    trainer logprob that is not the rollout's, bitwise. ``lora_rank`` > 0: train a LoRA adapter of
    that rank (transformers' gap is then not computed: it would need PEFT on top)."""
    lora = None
    if lora_rank:
        if not config.lora.max_loras:
            config = config.replace(lora={"max_loras": 2, "max_rank": max(lora_rank, config.lora.max_rank)})
        lora, compare_transformers = {"r": lora_rank, "lora_alpha": 2 * lora_rank, "target_modules": "all-linear"}, False
    engine = build_engine(config, registry)
    policy = PolicyModel.from_config(config, registry, param_dtype=torch.float32, lora=lora)  # fp32 master weights
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr)
    if lora:  # the adapter's version 1 (PEFT's initialisation: B = 0, the base model)
        engine.load_lora_adapter("policy", tensors=policy.adapter_tensors(), config=policy.adapter_config())
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, n=n, ignore_eos=True,
                            lora_name="policy" if lora else None)
    history = []
    for r in range(rounds):
        prompts = [torch.randint(0, 250, (int(torch.randint(4, 40, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(num_prompts)]
        outs = engine.generate(prompts, [attrs.evolve(params, seed=1000 * r + i) for i in range(num_prompts)])
        ps = [p for p, o in zip(prompts, outs) for _ in o.outputs]
        cs = [s.token_ids for o in outs for s in o.outputs]
        lps = policy.token_logprobs(ps, cs)
        if strict:
            check_on_policy(outs, lps)
        row = {"round": r, "gap": max_gap(outs, lps), "reward": sum(map(reward, cs)) / len(cs)}
        if compare_transformers:
            with torch.no_grad():
                row["transformers_gap"] = max_gap(outs, transformers_logprobs(to_transformers(policy), ps, cs))
        adv = group_advantages([reward(c) for c in cs], n)
        loss, stats = policy_loss(lps, [s.token_logprobs for o in outs for s in o.outputs], adv)
        row["max_ratio_gap"] = stats.max_ratio_gap
        opt.zero_grad()
        loss.backward()
        opt.step()
        if lora:  # the adapter alone, as the name's next version
            engine.load_lora_adapter("policy", tensors=policy.adapter_tensors(), config=policy.adapter_config())
        else:
            engine.update_weights(policy.state_dict())  # fp32 masters, rounded to the engine's dtype as .to() rounds
        history.append(row)
        print(f"round {r}: max|train - rollout| = {row['gap']:.3g}"
              + (f"  (transformers as the trainer: {row['transformers_gap']:.3g})" if compare_transformers else "")
              + f"  max|ratio - 1| = {stats.max_ratio_gap:.3g}  mean reward {row['reward']:.3f}", flush=True)
    return history


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/cpu_reference.yaml")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--strict", action="store_true", help="stop at the first token off the rollout's bits")
    ap.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (0: full weights)")
    a = ap.parse_args(argv)
    grpo(EngineConfig.from_yaml(a.config), rounds=a.rounds, num_prompts=a.prompts, n=a.n,
         max_new_tokens=a.max_new_tokens, lr=a.lr, strict=a.strict, lora_rank=a.lora_rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
