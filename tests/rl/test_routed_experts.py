"""Routing replay ("R3"): with ``model.enable_return_routed_experts`` a request can ask for the
top-k expert ids every MoE layer chose for each position that ran through the model; they are the
ids the engine used (equal to a reference forward's routing over the same tokens), whatever else
is in the batch, for AR and MTP, and a prompt's n samples share its prompt routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_config

from bi_core import ConfigError, EngineConfig, RequestError, SamplingParams, build_engine


def config(**over) -> EngineConfig:
    base = tiny_config(model={"random": {"preset": "tiny-moe", "seed": 3}, "enable_return_routed_experts": True},
                       scheduler={"prefill_chunk_size": 16, "max_num_batched_tokens": 64})
    for k, v in over.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return EngineConfig.from_dict(base)


def prompts():
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 37, 20)]


PARAMS = SamplingParams(max_new_tokens=9, temperature=0.8, seed=11, ignore_eos=True, return_routed_experts=True)


def reference_routing(cfg: EngineConfig, ids: list[int]) -> np.ndarray:
    """[positions, layers, k]: a fresh engine scores ``ids`` (one chunked prefill of every position
    but the last) while a pre-hook on each MoE layer routes that layer's input itself."""
    eng = build_engine(cfg)
    moes = eng.model.moe_layers()
    seen = [[] for _ in moes]
    for i, moe in enumerate(moes):
        def route(module, args, i=i):
            seen[i].append(module.topk.forward(module.gate(args[0])[:, : module.num_experts])[1].clone())
        moe.register_forward_pre_hook(route)
    eng.score(ids[:1], ids[1:], exact=False)
    return torch.stack([torch.cat(s) for s in seen], dim=1).numpy()


def test_routed_experts_are_the_ids_the_model_used():
    eng = build_engine(config())
    out = eng.generate(prompts(), PARAMS)
    ref_cfg = config(model={"enable_return_routed_experts": False})
    k = eng.model.args.num_experts_per_tok
    layers = len(eng.model.moe_layers())
    for o in out:
        r = o.routed_experts
        positions = len(o.prompt_token_ids) + len(o.token_ids) - 1
        assert r.dtype == np.int16 and r.shape == (positions, layers, k)
        want = reference_routing(ref_cfg, o.prompt_token_ids + o.token_ids)
        np.testing.assert_array_equal(r, want)


def test_routing_does_not_depend_on_the_batch_and_mtp_routes_as_ar():
    ps = prompts()
    batched = build_engine(config()).generate(ps, PARAMS)
    alone = [build_engine(config()).generate([p], PARAMS)[0] for p in ps]
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    mtp = build_engine(config(strategy={"name": "mtp", "num_speculative_tokens": 3}))
    mtp.strategy.draft_hook = lambda seq, d: [b.token_ids for b in batched][seq.request_id][
        len(seq.output_ids): len(seq.output_ids) + len(d)]  # drafts right: verify rows accepted
    for m, b in zip(mtp.generate(ps, PARAMS), batched):
        assert m.token_ids == b.token_ids and m.num_accepted_draft_tokens > 0
        np.testing.assert_array_equal(m.routed_experts, b.routed_experts)


def test_n_samples_share_the_prompt_routing_and_others_get_none():
    eng = build_engine(config())
    p = prompts()[1]
    out = eng.generate([p, p], [SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=2, ignore_eos=True,
                                               return_routed_experts=True), SamplingParams(max_new_tokens=4)])
    samples = out[0].outputs
    assert len({tuple(s.token_ids) for s in samples}) > 1  # distinct samples
    for s in samples:
        assert s.routed_experts.shape[0] == len(p) + len(s.token_ids) - 1
        np.testing.assert_array_equal(s.routed_experts[: len(p)], samples[0].routed_experts[: len(p)])
    assert out[1].routed_experts is None


def test_refusals():
    with pytest.raises(ConfigError, match="no MoE layers"):
        build_engine(config(model={"random": {"preset": "tiny-dense", "seed": 0}}))
    with pytest.raises(ConfigError, match="cache.prefix_caching"):
        build_engine(config(cache={"prefix_caching": True}))
    plain = build_engine(config(model={"enable_return_routed_experts": False}))
    with pytest.raises(RequestError, match="enable_return_routed_experts"):
        plain.add_request([1, 2, 3], PARAMS)


def test_routing_through_graph_replays_and_overlapped_steps():
    """Decode steps replaying (rerun) graphs log the routing inside the static step, and steps
    launched ahead (overlap) keep each step's routing apart."""
    import attrs

    from bi_core.runtime.graphs import CudaGraphRunner

    ps = prompts()
    want = build_engine(config(graph={"overlap": False})).generate(ps, PARAMS)
    greedy = attrs.evolve(PARAMS, temperature=0.0)  # device-sampled rows: steps fly and launch ahead
    want_greedy = build_engine(config(graph={"overlap": False})).generate(ps, greedy)
    for params, ref in ((PARAMS, want), (greedy, want_greedy)):
        eng = build_engine(config(graph={"overlap": True}))
        runner = eng.runner
        runner.main_graphs = CudaGraphRunner(attrs.evolve(runner.spec, use_graphs=True, capture=False))
        out = eng.generate(ps, params)
        assert runner.main_graphs.num_replays[1] > 0
        for o, w in zip(out, ref):
            assert o.token_ids == w.token_ids
            np.testing.assert_array_equal(o.routed_experts, w.routed_experts)
    assert eng.num_ahead > 0
