"""MTP speculative decoding emits the AR tokens (and logprobs within 1e-5 on the fp32 reference),
whatever the drafts: forced all-accepted, all-rejected and accepted-up-to-a-random-point drafts,
greedy and seeded sampling, alone and batched, dense and MoE; and the GDN state after an
accepted prefix is the state AR reaches at that position."""

from __future__ import annotations

import random

import attrs
import pytest
import torch
from helpers import tiny_config

from bi_core import ConfigError, EngineConfig, SamplingParams, build_engine

LENGTHS = (5, 40, 17, 70)
N_SPEC = 3


def config(preset: str, strategy: str, n: int = N_SPEC) -> EngineConfig:
    strat = {"name": strategy, "num_speculative_tokens": n} if strategy == "mtp" else {"name": "ar"}
    return EngineConfig.from_dict(tiny_config(model={"random": {"preset": preset, "seed": 1}}, strategy=strat,
                                              scheduler={"prefill_chunk_size": 32}))


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def hook_for(kind: str, truth: dict[int, list[int]], rng: random.Random, vocab: int = 260):
    def hook(seq, proposed):
        right = truth[seq.request_id][len(seq.output_ids): len(seq.output_ids) + N_SPEC]
        wrong = [(t + 1) % vocab for t in right]
        if kind == "all":
            return right
        if kind == "none":
            return wrong
        cut = rng.randint(0, len(right))
        return right[:cut] + wrong[cut:]
    return hook


PARAMS = {
    "greedy": SamplingParams(max_new_tokens=14, ignore_eos=True, logprobs=2),
    "sampled": SamplingParams(max_new_tokens=14, temperature=0.9, top_k=50, seed=77, ignore_eos=True),
}


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["all", "none", "partial"])
def test_mtp_equals_ar(preset, mode, kind):
    ps, params = prompts(), PARAMS[mode]
    ar = build_engine(config(preset, "ar")).generate(ps, params)
    truth = {i: o.token_ids for i, o in enumerate(ar)}
    for batch in (ps, [ps[1]]):  # batched, then alone
        eng = build_engine(config(preset, "mtp"))
        eng.strategy.draft_hook = hook_for(kind, truth if batch is ps else {0: truth[1]}, random.Random(5))
        out = eng.generate(batch, params)
        expected = ar if batch is ps else [ar[1]]
        for a, m in zip(expected, out):
            assert m.token_ids == a.token_ids
            torch.testing.assert_close(torch.tensor(m.token_logprobs), torch.tensor(a.token_logprobs),
                                       atol=1e-5, rtol=1e-5)
            if kind == "all":
                assert m.num_accepted_draft_tokens == m.num_draft_tokens > 0
                assert m.draft_acceptance == 1.0 and m.mean_accepted_per_step > 1
            if kind == "none":
                assert m.num_accepted_draft_tokens == 0 and m.num_draft_tokens > 0
                assert m.mean_accepted_per_step == 0.0


def test_mtp_pages_cover_drafts_across_page_boundaries():
    """Many prompt lengths around 16-token pages, all drafts accepted (the deepest KV writes)."""
    ps = [list(range(1, n + 1)) for n in range(10, 40, 3)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ar = build_engine(config("tiny-dense", "ar")).generate(ps, params)
    eng = build_engine(config("tiny-dense", "mtp", n=4))
    truth = {i: o.token_ids for i, o in enumerate(ar)}
    eng.strategy.draft_hook = lambda seq, d: truth[seq.request_id][len(seq.output_ids): len(seq.output_ids) + 4]
    assert [o.token_ids for o in eng.generate(ps, params)] == [o.token_ids for o in ar]


def test_mtp_drafts_from_the_head_are_verified():
    """Without a hook the (random) MTP head drafts; output still equals AR."""
    ps, params = prompts(), PARAMS["greedy"]
    ar = build_engine(config("tiny-moe", "ar")).generate(ps, params)
    eng = build_engine(config("tiny-moe", "mtp", n=2))
    out = eng.generate(ps, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    assert all(o.num_draft_tokens > 0 for o in out)
    assert not eng.strategy.drafts  # finished requests leave no drafts behind


def test_gdn_state_after_accepted_prefix_equals_ar_state():
    prompt = prompts()[2]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ar_out = build_engine(config("tiny-dense", "ar")).generate([prompt], params)[0].token_ids
    eng = build_engine(config("tiny-dense", "mtp"))
    eng.strategy.draft_hook = hook_for("partial", {0: ar_out}, random.Random(3))
    seq = eng.add_request(prompt, params)
    for _ in range(5):
        eng.step()
    length, ring = seq.num_computed, eng.cache.state_ring
    slot = seq.state_slot * ring + length % ring
    ar = build_engine(config("tiny-dense", "ar"))
    ar_seq = ar.add_request(prompt, params)
    while ar_seq.num_computed < length:
        ar.step()
    assert ar_seq.num_computed == length
    for mine, theirs in zip(eng.cache.main.recurrent, ar.cache.main.recurrent):
        torch.testing.assert_close(mine[slot], theirs[ar_seq.state_slot], atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(eng.cache.main.conv, ar.cache.main.conv):
        torch.testing.assert_close(mine[slot], theirs[ar_seq.state_slot])
    # the other ring slots hold other positions' states, so picking the wrong one is visible
    other = seq.state_slot * ring + (length + 1) % ring
    assert not torch.allclose(eng.cache.main.recurrent[0][other], ar.cache.main.recurrent[0][ar_seq.state_slot])


def test_mtp_needs_an_mtp_head(tmp_path):
    from hf_fixtures import make_hf_model, save_checkpoint

    path = save_checkpoint(make_hf_model("dense"), tmp_path / "ckpt")
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
           "strategy": {"name": "mtp", "num_speculative_tokens": 2}}
    with pytest.raises(ConfigError, match="strategy.name: mtp needs a checkpoint with an MTP head"):
        build_engine(EngineConfig.from_dict(cfg))


def test_mtp_from_a_checkpoint_matches_ar(tmp_path):
    """MTP weights loaded from a checkpoint (multimodal names, per-expert MTP experts)."""
    from hf_fixtures import make_hf_model, save_checkpoint

    path = save_checkpoint(make_hf_model("moe"), tmp_path / "ckpt", layout="multimodal", experts="fused",
                           with_mtp=True)
    base = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference"}
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ar = build_engine(EngineConfig.from_dict(base)).generate([[3, 4, 5, 6]], params)[0]
    mtp = build_engine(EngineConfig.from_dict({**base, "strategy": {"name": "mtp", "num_speculative_tokens": 4}}))
    out = mtp.generate([[3, 4, 5, 6]], params)[0]
    assert out.token_ids == ar.token_ids and out.num_draft_tokens > 0


def test_verify_tokens_count_against_the_step_budget():
    """A verify step runs 1+N tokens per sequence: the scheduler budgets them so, not as 1. Three
    sequences verify (3 x 4 tokens) while four 8-token prompts wait: three chunks fit beside them
    (36 of 36 tokens); counting verify rows as 1 would admit all four (44 tokens)."""
    budget = 7 * (1 + N_SPEC) + 8
    cfg = config("tiny-dense", "mtp").replace(scheduler={"max_num_seqs": 7, "max_num_batched_tokens": budget,
                                                         "prefill_chunk_size": 8})
    eng = build_engine(cfg)
    sizes = []
    run = eng.runner.execute
    eng.runner.execute = lambda fwd, **kw: (sizes.append(fwd.num_tokens) if fwd.head == "model" else None,
                                           run(fwd, **kw))[1]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 2, 2, 8, 8, 8, 8)]
    seqs = [eng.add_request(p, params) for p in ps[:3]]
    eng.step()  # the three short prompts prefill together; they decode from now on
    seqs += [eng.add_request(p, params) for p in ps[3:]]
    while eng.scheduler.has_work():
        eng.step()
    assert max(sizes) <= budget and 3 * (1 + N_SPEC) + 3 * 8 in sizes
    ar = build_engine(config("tiny-dense", "ar")).generate(ps, params)
    assert [s.output_ids for s in seqs] == [o.token_ids for o in ar]


def test_mtp_budget_without_room_for_verify_rows_and_a_chunk_is_an_error():
    """Every step must hold each sequence's verify row (1 + N tokens) and one prompt chunk."""
    seqs = 4
    budget = seqs * (1 + N_SPEC)
    cfg = config("tiny-dense", "mtp").replace(scheduler={"max_num_seqs": seqs, "max_num_batched_tokens": budget,
                                                         "prefill_chunk_size": 2})
    with pytest.raises(ConfigError, match=f"scheduler.max_num_batched_tokens: {budget} leaves no room for a prompt "
                       f"chunk beside the decode rows of scheduler.max_num_seqs={seqs} sequences \\({1 + N_SPEC} "):
        build_engine(cfg)
    build_engine(cfg.replace(scheduler={"max_num_batched_tokens": budget + 2}))  # one 2-token chunk fits


def drafts_on_device(eng, truth: dict[int, list[int]], rng: random.Random, vocab: int = 260) -> None:
    """Replace the MTP head's greedy drafts, on the device and inside the chain, by the AR tokens
    (each wrong with probability 0.3): the chain feeds them to its next step and the verify takes
    them from the device, as real drafts go (no hook, no wait for the host)."""
    real = eng.strategy._mtp

    def mtp(rows, hidden, ids_from=None):
        out = real(rows, hidden, ids_from)
        want = []
        for r in rows:  # logits row x of a head row at position p proposes the token at p + x + 2
            for x in r.logits_rows:
                k = r.start + x + 2 - len(r.seq.prompt_ids)
                t = truth[r.seq.request_id][k] if k < len(truth[r.seq.request_id]) else 0
                want.append((t + 1) % vocab if rng.random() < 0.3 else t)
        return attrs.evolve(out, logits=torch.tensor(want, dtype=out.logits.dtype, device=out.logits.device))
    eng.strategy._mtp = mtp


@pytest.mark.parametrize("n", [1, 2])
def test_drafts_staged_on_the_device_equal_ar(n):
    """Drafts never on the host before their verify (the path every real run takes): accepted
    and rejected ones give the AR tokens; with n samples a verify takes drafts from two chains
    (the leaders' and the forked samples')."""
    ps = prompts()
    params = SamplingParams(max_new_tokens=14, temperature=0.9, seed=5, ignore_eos=True, n=n)
    ar = build_engine(config("tiny-moe", "ar")).generate(ps, params)
    truth = {s.request_id: s.token_ids for o in ar for s in (o.samples or [o])}
    eng = build_engine(config("tiny-moe", "mtp"))
    drafts_on_device(eng, truth, random.Random(2))
    out = eng.generate(ps, params)
    for a, m in zip(ar, out):
        assert [s.token_ids for s in (m.samples or [m])] == [s.token_ids for s in (a.samples or [a])]
    accepted = [s.num_accepted_draft_tokens for o in out for s in (o.samples or [o])]
    drafted = [s.num_draft_tokens for o in out for s in (o.samples or [o])]
    assert sum(accepted) > 0 and sum(accepted) < sum(drafted), (accepted, drafted)
    assert not eng.strategy.drafts


def test_forced_drafts_overwrite_the_proposed_rows():
    """``draft_override`` (benchmarks, audits): forced rows replace the proposals on the device,
    short lists padded with 0; rows it leaves (None) keep the head's. Every row forced goes through
    one reused staging buffer (twice here, at two batch sizes); some rows forced through a flag."""
    eng = build_engine(config("tiny-dense", "mtp"))
    strat = eng.strategy
    seqs = [attrs.make_class("S", ["request_id"])(i) for i in range(3)]
    forced = {0: [7, 8, 9], 1: None, 2: [5]}
    strat.draft_override = lambda seq, n: forced[seq.request_id]
    proposed = torch.arange(9, dtype=torch.int64).view(3, N_SPEC) + 100
    ids = proposed.clone()
    strat._force(seqs, ids)
    assert ids.tolist() == [[7, 8, 9], [103, 104, 105], [5, 0, 0]]
    forced[1] = [1, 2, 3]
    for s in (3, 2):
        ids = proposed[:s].clone()
        strat._force(seqs[:s], ids)
        assert ids.tolist() == [[7, 8, 9], [1, 2, 3], [5, 0, 0]][:s]
    strat.draft_override = lambda seq, n: None
    ids = proposed.clone()
    strat._force(seqs, ids)
    assert torch.equal(ids, proposed)


def test_drafts_a_head_program_wrote_over_come_from_their_host_copy():
    """Drafts behind a verify are rows of a head program's static output, which the program's
    next replay writes over (``Lease``). A sequence that did not verify in between would stage
    another sequence's drafts: its plan takes their host copy instead (landed long since). While
    the lease holds, the verify stages them as indices into the device ids (the normal path)."""
    from bi_core.runtime.step import Landing, Scheduled
    from bi_core.strategies.drafts import Lease, OnDevice

    eng = build_engine(config("tiny-dense", "mtp"))
    seq = eng.add_request(prompts()[0], SamplingParams(max_new_tokens=14, ignore_eos=True))
    while not seq.is_decoding:
        eng.step()
    device = torch.tensor([[91, 92, 93]])  # what the program's next replay left there
    landing = Landing(device, torch.tensor([[11, 12, 13]]), None)  # the drafts, on the host
    lease = Lease()
    eng.strategy.drafts[seq.request_id] = OnDevice(landing, 0, lease)
    staged = eng.strategy.plan([Scheduled(seq, 1 + N_SPEC)]).forward
    assert staged.rows[0].tokens[1:] == [-1, -2, -3] and staged.ids_from.tolist() == [91, 92, 93]
    lease.valid = False
    plan = eng.strategy.plan([Scheduled(seq, 1 + N_SPEC)])
    assert plan.forward.rows[0].tokens[1:] == [11, 12, 13] and plan.forward.ids_from is None
    assert plan.drafts == [[11, 12, 13]] and plan.on_device == [None]
