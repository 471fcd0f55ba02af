"""The on-policy audit at scale: roll out n samples of many prompts, then check that
``PolicyModel``'s logprob of every sampled token equals the rollout's bitwise under three
micro-batchings of the training batch, before and after an optimizer step + weight sync, with AR
and (``--mtp``) MTP rollouts; transformers' own forward on the same data is the control (the gap
users have today).

    python benchmarks/train_parity.py benchmarks/configs/qwen35b_invariant.yaml --layers 8 \\
        --prompts 64 --n 8 --prompt-len 512 --new-tokens 256 --mtp --json $OUT/parity.json

Prints one line per check and writes every count to ``--json``."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402
from bi_core.runtime import gc_heap  # noqa: E402
from bi_core.runtime.build import resolve_model  # noqa: E402
from bi_core.train import PolicyModel, rollout_logprobs  # noqa: E402


def with_changes(config: EngineConfig, **changes) -> EngineConfig:
    """The config with dotted keys changed (``model.random.num_hidden_layers=8``), validated anew."""
    d = config.to_dict()
    for key, value in changes.items():
        *path, leaf = key.split("__")
        node = d
        for part in path:
            node = node[part]
        node[leaf] = value
    return EngineConfig.from_dict(d)


def rollout(engine, prompts: list[list[int]], n: int, new_tokens: int, seed: int):
    params = [SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed + i, n=n, ignore_eos=True)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    ps = [p for p, o in zip(prompts, outs) for _ in o.outputs]
    cs = [s.token_ids for o in outs for s in o.outputs]
    return ps, cs, rollout_logprobs(outs), time.perf_counter() - t0


def micro_batchings(num: int, seed: int) -> dict[str, list[list[int]]]:
    """In order by 8; shuffled by 32; shuffled in random sizes 1..16."""
    rng = random.Random(seed)
    shuffled = list(range(num))
    rng.shuffle(shuffled)
    ragged, i = [], 0
    while i < num:
        k = rng.randint(1, 16)
        ragged.append(shuffled[i:i + k])
        i += k
    return {"in order, 8 a batch": [list(range(a, min(a + 8, num))) for a in range(0, num, 8)],
            "shuffled, 32 a batch": [shuffled[a:a + 32] for a in range(0, num, 32)],
            "shuffled, 1-16 a batch": ragged}


@torch.no_grad()
def mismatches(policy, ps, cs, want, order) -> tuple[int, int, float]:
    """(differing tokens, tokens, seconds) of the policy's logprobs against ``want``."""
    bad = total = 0
    t0 = time.perf_counter()
    for mb in order:
        got = policy.token_logprobs([ps[i] for i in mb], [cs[i] for i in mb])
        for i, lp in zip(mb, got):
            w = torch.tensor(want[i], dtype=torch.float32).view(torch.int32)
            bad += int((lp.cpu().view(torch.int32) != w).sum())
            total += w.numel()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return bad, total, time.perf_counter() - t0


def audit(policy, ps, cs, want, label: str, seed: int, report: dict) -> None:
    for name, order in micro_batchings(len(ps), seed).items():
        bad, total, dt = mismatches(policy, ps, cs, want, order)
        report[f"{label} / {name}"] = {"mismatches": bad, "tokens": total, "seconds": round(dt, 2)}
        print(f"{label} / {name}: {bad} of {total} tokens differ ({dt:.1f} s)", flush=True)


def transformers_gap(policy, ps, cs, want, limit: int) -> dict:
    from bi_core.train.hf import to_transformers, transformers_logprobs

    model = to_transformers(policy)
    with torch.no_grad():
        got = transformers_logprobs(model, ps[:limit], cs[:limit])
    del model
    gc_heap.collect()
    d = torch.cat([(lp.double().cpu() - torch.tensor(w, dtype=torch.float64)).abs() for lp, w in zip(got, want)])
    out = {"sequences": len(got), "tokens": int(d.numel()), "mismatches": int((d != 0).sum()),
           "mean_abs_diff": float(d.mean()), "max_abs_diff": float(d.max())}
    print(f"transformers as the trainer: {out['mismatches']} of {out['tokens']} tokens differ, mean |diff| "
          f"{out['mean_abs_diff']:.3g}, max {out['max_abs_diff']:.3g}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--layers", type=int, default=None, help="model.random.num_hidden_layers")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--mtp", type=int, default=0, help="also roll out with MTP, this many draft tokens")
    ap.add_argument("--transformers", type=int, default=64, help="sequences the transformers control scores")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    config = EngineConfig.from_yaml(a.config)
    if a.layers is not None:
        config = with_changes(config, model__random__num_hidden_layers=a.layers)
    gen = torch.Generator().manual_seed(0)
    vocab = resolve_model(config)[0].vocab_size
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=gen).tolist() for _ in range(a.prompts)]
    report: dict = {"config": a.config, "layers": a.layers, "prompts": a.prompts, "n": a.n, "prompt_len": a.prompt_len,
                    "new_tokens": a.new_tokens, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    engine = build_engine(config)
    ps, cs, want, dt = rollout(engine, prompts, a.n, a.new_tokens, seed=1)
    print(f"rollout: {len(cs)} completions in {dt:.1f} s", flush=True)
    policy = PolicyModel.from_config(config)
    audit(policy, ps, cs, want, "AR rollout", 0, report)
    report["transformers control"] = transformers_gap(policy, ps, cs, want, a.transformers)
    # one optimizer step on a micro-batch, the engine synced from the policy, a new rollout
    opt = torch.optim.SGD(policy.parameters(), lr=1e-4)
    lps = policy.token_logprobs(ps[:4], cs[:4])
    (-torch.cat(lps).mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    engine.update_weights(policy.state_dict())
    ps2, cs2, want2, _ = rollout(engine, prompts[: max(1, a.prompts // 4)], a.n, a.new_tokens, seed=2)
    audit(policy, ps2, cs2, want2, "after a step and a sync", 1, report)
    if a.mtp:
        del engine
        gc_heap.collect()
        mtp = build_engine(with_changes(config, strategy__name="mtp", strategy__num_speculative_tokens=a.mtp))
        mtp.update_weights(policy.state_dict())
        ps3, cs3, want3, dt = rollout(mtp, prompts[: max(1, a.prompts // 4)], a.n, a.new_tokens, seed=3)
        print(f"MTP rollout: {len(cs3)} completions in {dt:.1f} s", flush=True)
        audit(policy, ps3, cs3, want3, "MTP rollout", 2, report)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    bad = sum(v["mismatches"] for k, v in report.items() if isinstance(v, dict) and k != "transformers control")
    print("ON-POLICY: every sampled token bitwise" if bad == 0 else f"NOT ON-POLICY: {bad} tokens differ", flush=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
