"""MoE experts with LoRA adapters (bi_core/kernels/moe_lora.py, backends/reference/moe.py
``with_lora``): a token's output is the same bits alone and among tokens of other adapters and
none, close to the reference; a whole engine with expert adapters gives a request the same logits,
tokens and logprobs alone and in a mixed batch (G1), with negative controls."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_lora_interp import attrs_evolve, lora_config
from triton_anywhere import TritonAnywhere

from bi_core import SamplingParams, build_engine
from bi_core.backends.reference.moe import with_lora
from bi_core.ops.moe import ExpertLora
from bi_core.plugins import load_registry

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from lora_fixtures import random_adapter  # noqa: E402

E, K, H, W, R, S = 6, 2, 80, 48, 8, 3  # experts, top-k, hidden, expert width, rank, adapter slots


def moe_case(dtype, gen, tokens: int = 13):
    """Random experts (the last is the shared one), routing, logits and adapter stacks."""
    def rnd(*shape, fan):
        return (torch.randn(*shape, generator=gen) / fan ** 0.5).to(dtype)

    w13, w2 = rnd(E + 1, 2 * W, H, fan=H), rnd(E + 1, H, W, fan=W)
    x = rnd(tokens, H, fan=1)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1)
    logits = rnd(tokens, fan=1)
    routed = (rnd(S * E, R, H, fan=H), rnd(S * E, 2 * W, R, fan=R), rnd(S * E, R, W, fan=W), rnd(S * E, H, R, fan=R))
    shared = (rnd(S, 2 * R, H, fan=H), rnd(S, 2 * W, 2 * R, fan=R), rnd(S, R, W, fan=W), rnd(S, H, R, fan=R))
    return x, weights, ids, w13, w2, logits, routed, shared


def bind(routed, shared, ids, slots):
    s = slots[:, None]
    pairs = torch.where(s >= 0, s * E + ids, -1)
    pairs = torch.cat([pairs, torch.full_like(s, -1)], 1).reshape(-1)
    return ExpertLora(*routed, pairs=pairs, shared=shared, slots=slots)


def triton_moe(x, weights, ids, w13, w2, logits, lora):
    from bi_core.kernels.moe_lora import moe_lora

    return moe_lora(x, weights, ids, w13, w2, logits, lora)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_alone_equals_token_in_a_mixed_batch(device, dtype):
    """Token 0 (slot 2) alone and among 13 tokens of slots 0..2 and -1: bitwise; close to the
    reference; other slot or an adapter on the token's own expert changes its bits, one on an
    expert it is not routed to does not (the pair's expert picks its stack row)."""
    gen = torch.Generator().manual_seed(0)
    x, weights, ids, w13, w2, logits, routed, shared = (
        t.to(device) if isinstance(t, torch.Tensor) else tuple(u.to(device) for u in t)
        for t in moe_case(dtype, gen))
    slots = torch.tensor([2, 0, -1, 1, 2, 1, -1, 0, 2, 2, 1, -1, 0], device=device)

    def run(rows, slots_, routed_=routed):
        lora = bind(routed_, shared, ids[rows], slots_)
        return triton_moe(x[rows], weights[rows], ids[rows], w13, w2, logits[rows], lora)

    every, first = slice(None), slice(0, 1)
    mixed, alone = run(every, slots), run(first, slots[:1])
    assert torch.equal(mixed[:1], alone)
    ref = with_lora(x.cpu(), weights.cpu(), ids.cpu(), w13.cpu(), w2.cpu(), logits.cpu(),
                    bind(tuple(t.cpu() for t in routed), tuple(t.cpu() for t in shared), ids.cpu(), slots.cpu()))
    err = (mixed.float().cpu() - ref.float()).norm() / ref.float().norm()
    assert err < (6e-2 if dtype == torch.bfloat16 else 1e-5)  # bf16: the base fused MoE is as far (interpreter)
    assert not torch.equal(run(first, torch.tensor([1], device=device)), alone)
    own, other = int(ids[0, 0]), next(e for e in range(E) if e not in ids[0].tolist())
    for expert, changes in ((own, True), (other, False)):
        bumped = tuple(t.clone() for t in routed)
        bumped[3][2 * E + expert] *= 2  # slot 2's down B of that expert
        assert torch.equal(run(first, slots[:1], bumped), alone) != changes


def load_expert_adapters(engine) -> None:
    for name, r, seed in (("a", 8, 1), ("b", 16, 2), ("c", 4, 3)):
        cfg, tensors = random_adapter(engine, r=r, seed=seed)
        assert "target_parameters" in cfg  # the experts' parameters are in it
        engine.load_lora_adapter(name, tensors=tensors, config=cfg)


@pytest.mark.usefixtures("ordered_dot")
def test_expert_adapter_request_alone_and_in_a_mixed_batch_bitwise(device):
    """With lora.experts, a needle on adapter "a" (seeded sampling) alone and among requests on
    "b", "c" and none: the same tokens, logprobs and last-prompt-row logits. Negative control: on
    "a" without its expert tensors the needle's logits differ (the experts' deltas reach the bits)."""
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    gen = torch.Generator().manual_seed(11)
    needle, *others = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (20, 9, 41, 4)]
    hot = SamplingParams(max_new_tokens=3, temperature=0.8, seed=1234, ignore_eos=True, logprobs=1, lora_name="a")
    rest = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=1, lora_name=lo)
            for n, lo in ((2, "b"), (4, None), (3, "c"))]

    def run(prompts, params, *, drop_experts=False):
        eng, seen = build_engine(lora_config(device, experts=True), registry), []
        load_expert_adapters(eng)
        if drop_experts:  # "a" again, without its expert tensors
            cfg, tensors = random_adapter(eng, r=8, seed=1)
            keep = {k: v for k, v in tensors.items() if ".experts" not in k and ".shared_expert." not in k}
            eng.load_lora_adapter("a", tensors=keep, config={k: v for k, v in cfg.items() if k != "target_parameters"})
        eng.runner.on_logits = lambda seqs, logits: seen.extend(
            logits[i].clone() for i, q in enumerate(seqs) if q.prompt_ids == needle and not q.output_ids)
        outs = eng.generate(prompts, params)
        return outs, seen[0]

    (alone,), alone_row = run([needle], [hot])
    batch, batch_row = run(others[:1] + [needle] + others[1:], rest[:1] + [hot] + rest[1:])
    assert torch.equal(batch_row, alone_row)
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].token_logprobs == alone.token_logprobs and batch[1].logprobs == alone.logprobs
    _, dropped = run([needle], [hot], drop_experts=True)
    assert not torch.equal(dropped, alone_row)
    _, swapped = run([needle], [attrs_evolve(hot, lora_name="b")])
    assert not torch.equal(swapped, alone_row)
