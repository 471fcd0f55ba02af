"""Where a trainer logprob leaves the engine's (GPU): weights, then every layer's ops for one
sequence driven through the engine's model step by step (its prompt in one chunk, then one-token
decode steps) against the trainer's forward, then variants of the trainer's layout.

    python dev/probes/train_parity_probe.py benchmarks/configs/qwen35b_invariant.yaml --layers 4"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from train_parity import with_changes  # noqa: E402

from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402
from bi_core.policies.apply import applied  # noqa: E402
from bi_core.runtime.batch import build_context  # noqa: E402
from bi_core.runtime.build import resolve_model  # noqa: E402
from bi_core.train import PolicyModel  # noqa: E402


def compare(name, want, got) -> bool:
    w, g = torch.as_tensor(want, dtype=torch.float32), torch.as_tensor(got, dtype=torch.float32).cpu()
    eq = int((w.view(torch.int32) == g.view(torch.int32)).sum())
    print(f"{name}: {eq} of {w.numel()} equal, max |diff| {(w - g).abs().max().item():.3g}", flush=True)
    return eq == w.numel()


def hooks(model, store: dict):
    handles = []
    for i, layer in enumerate(model.layers):
        for part in ("input_layernorm", "mixer", "post_attention_layernorm", "mlp"):
            def rec(mod, inp, out, key=(i, part)):
                t = out[0] if isinstance(out, tuple) else out
                t = getattr(t, "x", t)
                store.setdefault(key, []).append(t.detach().clone())
            handles.append(getattr(layer, part).register_forward_hook(rec))
    return handles


def engine_steps(engine, policy, prompt, completion, policy_ctx):
    """The engine's model over one sequence: the prompt as one chunk, then each completion input as
    a one-token decode step; per (layer, op), the rows in order."""
    model, dev = engine.runner.model, engine.runner.device
    store: dict = {}
    hs = hooks(model, store)
    caches = policy._caches(policy_ctx)  # fresh caches, the trainer's shapes
    blocks = list(range(policy_ctx.num_blocks - 1))
    with torch.inference_mode(), applied(engine.policy):
        ids, ctx = build_context([prompt], [0], [blocks], [0], [False], block_size=engine.cache.block_size, device=dev)
        model(ids, ctx, caches)
        for j, t in enumerate(completion[:-1]):
            ids, ctx = build_context([[t]], [len(prompt) + j], [blocks], [0], [True], block_size=engine.cache.block_size,
                                     device=dev)
            model(ids, ctx, caches)
    for h in hs:
        h.remove()
    return {k: torch.cat(v) for k, v in store.items()}


def one_token_gdn(policy, prompts, cs):
    """The trainer's forward with every completion token's GDN in a call of its own (as decode steps)."""
    from bi_core.train import layout as L

    ctx = policy.plan(prompts, cs)
    s = policy._shape
    prompts_, comps = [list(p) for p in prompts], [list(c) for c in cs]
    blocks, page = [], 0
    for p, c in zip(prompts_, comps):
        n = -(-(len(p) + len(c) - 1) // s.block_size)
        blocks.append(list(range(page, page + n)))
        page += n
    calls = ctx.gdn[:-1]
    for j in range(max(len(c) for c in comps) - 1):
        pieces = [(i, len(p) + j, len(p) + j + 1) for i, (p, c) in enumerate(zip(prompts_, comps)) if j < len(c) - 1]
        calls.append(L._gdn_call(pieces, prompts_, comps, ctx.spans, blocks, [True] * len(pieces), s.block_size,
                                 policy.device))
    ctx.gdn = calls
    return list(torch.split(policy(ctx), ctx.completion_lens))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args(argv)
    config = with_changes(EngineConfig.from_yaml(a.config), model__random__num_hidden_layers=a.layers)
    engine = build_engine(config)
    gen = torch.Generator().manual_seed(0)
    vocab = resolve_model(config)[0].vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (512, 300, 77, 512)]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=16, temperature=1.0, seed=i, ignore_eos=True)
                                     for i in range(4)])
    cs = [o.token_ids for o in outs]
    exact = engine.score(prompts, cs)
    compare("engine exact score vs sampled (G7)", [x for o in outs for x in o.token_logprobs],
            [x for s in exact for x in s.token_logprobs])
    policy = PolicyModel.from_config(config)
    # 1. the weights
    bad = []
    eng_params = dict(engine.runner.model.named_parameters())
    for i, layer in enumerate(policy.model.layers):
        for name, t in layer.engine_params().items():
            if not torch.equal(t.detach(), eng_params[f"layers.{i}.{name}"].detach()):
                bad.append(f"layers.{i}.{name}")
    for name, t in (("embed_tokens", policy.model.embed_tokens.weight), ("norm.weight", policy.model.norm.weight),
                    ("lm_head.weight", getattr(getattr(policy, "lm_head", None), "weight", None))):
        if t is not None and not torch.equal(t.detach(), eng_params[name].detach()):
            bad.append(name)
    print(f"weights: {len(bad)} engine parameters differ from the trainer's fused ones: {bad[:8]}", flush=True)
    want = [x for o in outs for x in o.token_logprobs]
    with torch.no_grad():
        compare("trainer (as shipped)", want, torch.cat(policy.token_logprobs(prompts, cs)))
        with applied(engine.policy):
            compare("trainer under the engine's policy flags", want, torch.cat(policy.token_logprobs(prompts, cs)))
        first = [o.token_logprobs[0] for o in outs]
        compare("first tokens (prompt rows)", first, [lp[0] for lp in policy.token_logprobs(prompts, cs)])
        shape = policy._shape
        policy._shape = attrs.evolve(shape, decode_tokens=1)
        compare("trainer, decode pieces of 1 token", want, torch.cat(policy.token_logprobs(prompts, cs)))
        policy._shape = shape
        compare("trainer, GDN completions in one-token calls", want, torch.cat(one_token_gdn(policy, prompts, cs)))
        # 2. one sequence, op by op
        ctx = policy.plan([prompts[2]], [cs[2]])
        ref = engine_steps(engine, policy, prompts[2], cs[2], ctx)
        store: dict = {}
        hs = hooks(policy._engine, store)
        policy(ctx)
        for h in hs:
            h.remove()
        mine = {k: torch.cat(v) for k, v in store.items()}
        p = len(prompts[2])
        for key in sorted(ref):
            r, m = ref[key], mine[key]
            if r.shape != m.shape:
                print(f"layer {key[0]} {key[1]}: shapes {tuple(r.shape)} vs {tuple(m.shape)}")
                continue
            rows = (r != m).any(dim=-1)
            prompt_bad, dec_bad = int(rows[:p].sum()), int(rows[p:].sum())
            print(f"layer {key[0]} {key[1]:<24}: prompt rows differing {prompt_bad}/{p}, completion rows {dec_bad}/"
                  f"{rows.numel() - p}, max |diff| {(r.float() - m.float()).abs().max().item():.3g}", flush=True)
            if prompt_bad or dec_bad:
                break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
