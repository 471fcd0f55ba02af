"""The on-policy contract on the invariant backend's Triton kernels (CPU: Triton's interpreter with
``ordered_dot``; GPU: the kernels themselves): a ``PolicyModel`` built from the engine's config
gives every sampled completion token the logprob the engine reported, bitwise, whatever the
micro-batching and packing order of the training batch; AR and MTP rollouts, n samples, prefix
cache hits, after an optimizer step and a weight sync. Negative controls: the trainer on the
reference backend, and the trainer with another prompt chunk grid, must differ."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import tiny_config
from triton_anywhere import RERUN_GRAPHS, TritonAnywhere

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.plugins import load_registry
from bi_core.train import OnPolicyMismatch, PolicyModel, check_on_policy, ops, rollout_logprobs

pytestmark = pytest.mark.usefixtures("ordered_dot")  # numpy's dot would round a row by its place in a tile

CHUNK = 16
# 33 = two chunks and a one-token last chunk (the engine runs that one in decode form)
PROMPT_LENS = (9, 33, 20, 4)


def _config(device, backend="triton_anywhere", preset="tiny-moe", strategy=None, **extra) -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": preset, "seed": 3}, "device": device.type, "max_model_len": 128},
        backend=backend, graph=RERUN_GRAPHS if backend != "reference" else {}, strategy=strategy or {"name": "ar"},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": CHUNK}, **extra))


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 250, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _params() -> list[SamplingParams]:
    """Seeded T=1 with two samples, greedy, seeded T=0.8, seeded T=1."""
    return [SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, n=2, ignore_eos=True),
            SamplingParams(max_new_tokens=5, ignore_eos=True),
            SamplingParams(max_new_tokens=7, temperature=0.8, seed=12, ignore_eos=True),
            SamplingParams(max_new_tokens=4, temperature=1.0, seed=13, ignore_eos=True)]


def _batch(prompts, outputs) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """(prompt, completion, sampled logprobs) per sampled sequence, every sample of n > 1."""
    ps, cs = [], []
    for p, o in zip(prompts, outputs):
        for s in o.outputs:
            ps.append(p)
            cs.append(s.token_ids)
    return ps, cs, rollout_logprobs(outputs)


def _train(policy, ps, cs, order: list[list[int]]) -> list[torch.Tensor]:
    """The trainer's logprobs in micro-batches ``order`` (lists of sequence indices), back in order."""
    got: dict[int, torch.Tensor] = {}
    for mb in order:
        for i, lp in zip(mb, policy.token_logprobs([ps[i] for i in mb], [cs[i] for i in mb])):
            got[i] = lp.detach()
    return [got[i] for i in range(len(ps))]


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense"])
def test_trainer_logprobs_are_the_rollouts_bitwise(device, preset, monkeypatch):
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    config = _config(device, preset=preset)
    prompts = _prompts()
    ps, cs, want = _batch(prompts, build_engine(config, registry).generate(prompts, _params()))
    policy = PolicyModel.from_config(config, registry)
    n = len(ps)
    for order in ([list(range(n))], [[i] for i in reversed(range(n))], [[3, 0], [4, 1, 2]]):
        check_on_policy(want, _train(policy, ps, cs, order))
        monkeypatch.setattr(ops, "HEAD_BLOCK", 5)  # the lm_head in blocks of 5 rows from the second on
    # negative controls: the reference backend's kernels, and prompts in chunks of 8 instead of 16
    reference = PolicyModel.from_config(_config(device, "reference", preset=preset))
    with pytest.raises(OnPolicyMismatch):
        check_on_policy(want, reference.token_logprobs(ps, cs))
    policy._shape = attrs.evolve(policy._shape, chunk_size=CHUNK // 2)
    with pytest.raises(OnPolicyMismatch, match="differ from the rollout"):
        check_on_policy(want, policy.token_logprobs(ps, cs))


def test_mtp_rollouts_are_on_policy(device):
    """Drafts forced to be accepted about half the time: the verified tokens' logprobs equal the
    trainer's (MTP verify runs decode arithmetic)."""
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    config = _config(device, strategy={"name": "mtp", "num_speculative_tokens": 2})
    prompts = _prompts()
    ar = build_engine(_config(device), registry).generate(prompts, _params())
    truth = {tuple(p): [s.token_ids for s in o.outputs] for p, o in zip(prompts, ar)}
    engine = build_engine(config, registry)
    flip = iter(range(10_000))
    engine.strategy.draft_hook = lambda seq, d: [
        t if next(flip) % 2 else (t + 1) % 250
        for t in truth[tuple(seq.prompt_ids)][seq.sample_index][len(seq.output_ids):][:len(d)]]
    out = engine.generate(prompts, _params())
    assert sum(o.num_accepted_draft_tokens for r in out for o in r.outputs) > 0
    ps, cs, want = _batch(prompts, out)
    check_on_policy(want, PolicyModel.from_config(_config(device), registry).token_logprobs(ps, cs))


def test_after_a_step_and_a_sync_with_prefix_cache_hits(device):
    """Train one step, sync the engine from ``policy.state_dict()``, roll out again (the second
    rollout of a prompt hits the prefix cache): still bitwise on-policy."""
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    config = _config(device, cache={"prefix_caching": True})
    engine = build_engine(config, registry)
    policy = PolicyModel.from_config(config, registry)
    prompts = _prompts()[:2]
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=21, ignore_eos=True)] * 2
    ps, cs, want = _batch(prompts, engine.generate(prompts, params))
    lps = policy.token_logprobs(ps, cs)
    check_on_policy(want, lps)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    (-torch.cat(lps).sum()).backward()
    opt.step()
    engine.update_weights(policy.state_dict())
    first = engine.generate(prompts, params)
    second = engine.generate(prompts, params)
    assert second[1].num_cached_tokens > 0
    for out in (first, second):
        ps, cs, want = _batch(prompts, out)
        check_on_policy(want, policy.token_logprobs(ps, cs))


def test_logprobs_at_the_sampling_temperature(device):
    """Requests with ``logprobs_mode="temperature"`` report log_softmax(logits / T) of what they
    sampled (SGLang's default); the trainer at that temperature gives those bits, and at 1.0 not."""
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    config = _config(device)
    prompts = _prompts()[:2]
    params = [SamplingParams(max_new_tokens=4, temperature=t, seed=41, ignore_eos=True, logprobs_mode="temperature")
              for t in (0.7, 1.3)]
    outs = build_engine(config, registry).generate(prompts, params)
    policy = PolicyModel.from_config(config, registry)
    for p, o, t in zip(prompts, outs, (0.7, 1.3)):
        check_on_policy([o], policy.token_logprobs([p], [o.token_ids], temperature=t))
        with pytest.raises(OnPolicyMismatch):
            check_on_policy([o], policy.token_logprobs([p], [o.token_ids]))


def test_check_on_policy_names_the_first_difference():
    want = [[-1.0, -2.0], [-0.5]]
    check_on_policy(want, [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])])
    with pytest.raises(OnPolicyMismatch, match=r"1 of 3 completion tokens differ.*sequence 0, token 1"):
        check_on_policy(want, [torch.tensor([-1.0, -2.0000002]), torch.tensor([-0.5])])
    with pytest.raises(OnPolicyMismatch, match="sequence 1: the rollout has 1 tokens, the trainer 2"):
        check_on_policy(want, [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -0.1])])
    with pytest.raises(OnPolicyMismatch, match="0x80000000"):  # -0.0 is not 0.0
        check_on_policy([[0.0]], [torch.tensor([-0.0])])


def test_fp8_rollouts_are_on_policy_before_and_after_a_sync(device):
    """Block-FP8 (W8A8) rollouts: the trainer keeps bf16 weights and quantizes them at every forward
    as the engine quantizes a weight sync, so its logprobs are the FP8 engine's bitwise, at the
    start (random weights quantized on load) and after a step and a sync."""
    registry = load_registry(extra_plugins=(TritonAnywhere(),))
    config = _config(device, preset="tiny-moe-b128").replace(model={"quantization": "fp8"})
    engine = build_engine(config, registry)
    policy = PolicyModel.from_config(config, registry)
    assert not any(p.dtype == torch.float8_e4m3fn for p in policy.parameters())
    prompts = _prompts()[1:3]
    params = [SamplingParams(max_new_tokens=4, temperature=1.0, seed=31, ignore_eos=True)] * 2
    ps, cs, want = _batch(prompts, engine.generate(prompts, params))
    lps = policy.token_logprobs(ps, cs)
    check_on_policy(want, lps)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    (-torch.cat(lps).sum()).backward()
    opt.step()
    engine.update_weights(policy.state_dict())
    ps, cs, want = _batch(prompts, engine.generate(prompts, params))
    check_on_policy(want, policy.token_logprobs(ps, cs))
