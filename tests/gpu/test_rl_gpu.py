"""RL rollout features on the invariant backend with CUDA graphs, bitwise, each with a negative
control: exact scoring reproduces sampled logprobs (fast chunked scoring does not); each of n
samples equals the request sent alone (a fork without the GDN state copy does not); a request
served from the prefix cache equals it served cold, in a batch (a snapshot inside a chunk does
not); weights updated in place give what a fresh engine with those weights gives."""

from __future__ import annotations

import attrs
import pytest
import torch
from hf_fixtures import make_hf_model, save_checkpoint
from test_engine_gpu import gpu_config, prompts

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.ops.sampling import sample_seed

pytestmark = pytest.mark.gpu
VOCAB = 248320


def engine(**sections):
    cfg = gpu_config("cuda_hopper_invariant", "qwen3.5-35b-a3b", layers=4, graphs=True, invariant=True)
    return build_engine(cfg.replace(**sections))


def same(a, b) -> bool:
    return a.token_ids == b.token_ids and a.token_logprobs == b.token_logprobs


def test_exact_scoring_reproduces_sampled_logprobs():
    eng = engine()
    ps = prompts(12, seed=3, vocab=VOCAB)
    gen = eng.generate(ps, SamplingParams(max_new_tokens=24, temperature=1.0, seed=9, ignore_eos=True))
    exact = eng.score(ps, [g.token_ids for g in gen])
    fast = eng.score(ps, [g.token_ids for g in gen], exact=False)
    assert all(s.token_logprobs == g.token_logprobs for s, g in zip(exact, gen))
    equal = sum(a == b for s, g in zip(fast, gen) for a, b in zip(s.token_logprobs, g.token_logprobs))
    assert equal < sum(len(g.token_ids) for g in gen)  # negative control: chunked arithmetic differs somewhere
    for s, g in zip(fast, gen):
        torch.testing.assert_close(torch.tensor(s.token_logprobs), torch.tensor(g.token_logprobs), atol=0.5, rtol=0)


@pytest.mark.parametrize("break_fork", [False, True], ids=["fork", "negative-control"])
def test_each_of_n_samples_equals_the_request_alone(break_fork):
    eng = engine()
    ps = prompts(10, seed=4, vocab=VOCAB)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=21, n=8, ignore_eos=True)
    if break_fork:  # the samples keep a zero GDN state instead of the prompt's
        eng.cache.copy_states = lambda src, dst: None
    outs = eng.generate(ps, [params] + [attrs.evolve(params, n=1, seed=i) for i in range(1, 10)])
    alone = engine()
    results = [same(s, alone.generate([ps[0]], attrs.evolve(params, n=1, seed=sample_seed(21, i)))[0])
               for i, s in enumerate(outs[0].outputs)]
    assert results[0]  # the leader computed its prompt itself
    assert all(results[1:]) != break_fork


@pytest.mark.parametrize("grid", ["chunk", "page"], ids=["chunk-grid", "negative-control"])
def test_prefix_cache_hit_equals_cold_in_a_batch(grid):
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (600,), generator=g).tolist()
    a, b = shared + torch.randint(0, VOCAB, (40,), generator=g).tolist(), shared + [7] * 50
    sched = {"max_num_seqs": 64, "max_num_batched_tokens": 4096, "prefill_chunk_size": 256}
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1, ignore_eos=True)
    cold = engine(scheduler=sched, cache={"num_blocks": 4096, "prefix_caching": False}).generate([b], params)[0]
    eng = engine(scheduler=sched)
    if grid == "page":  # snapshots after any page-aligned chunked step, inside a chunk of a longer prompt
        eng.cache.prefix.grid = eng.cache.block_size
        a = shared[:528]  # its last chunk [512, 528) ends inside the chunk [512, 768) of b
    eng.generate([a], params)
    others = prompts(20, seed=7, vocab=VOCAB)
    got = eng.generate([b, *others], params)[0]
    assert got.num_cached_tokens == (512 if grid == "chunk" else 528)
    assert same(got, cold) == (grid == "chunk")


def checkpoint_engine(path):
    """The invariant backend with graphs on a saved tiny MoE checkpoint."""
    return build_engine(EngineConfig.from_dict({
        "model": {"path": str(path), "dtype": "bfloat16", "device": "cuda"}, "backend": "cuda_hopper_invariant",
        "policy": {"batch_invariant": True}, "graph": {"enabled": True},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512}, "cache": {"num_blocks": 256}}))


def two_checkpoints(tmp_path):
    """(model b, path a, path b): two tiny random MoE checkpoints."""
    a, b = make_hf_model("moe", seed=0), make_hf_model("moe", seed=1)
    return b, save_checkpoint(a, tmp_path / "a"), save_checkpoint(b, tmp_path / "b")


UPDATE_PROMPTS = prompts(6, seed=8, vocab=300)
UPDATE_PARAMS = SamplingParams(max_new_tokens=12, temperature=0.8, seed=2, ignore_eos=True)


def test_update_weights_in_place_with_graphs(tmp_path):
    b, path_a, path_b = two_checkpoints(tmp_path)
    build, ps, params = checkpoint_engine, UPDATE_PROMPTS, UPDATE_PARAMS
    eng = build(path_a)
    before = eng.generate(ps, params)
    eng.update_weights(b.state_dict())
    after = eng.generate(ps, params)
    fresh = build(path_b).generate(ps, params)
    assert not all(same(x, y) for x, y in zip(after, before))  # the update changed something
    assert all(same(x, y) for x, y in zip(after, fresh))


def _cuda_sharer(path, conn) -> None:
    """A colocated trainer: a checkpoint's tensors on this GPU, shared by CUDA IPC handle."""
    from safetensors.torch import load_file

    from bi_core.rl import serialize_named_tensors

    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update({n: t.to("cuda") for n, t in load_file(f).items()})
    conn.send(serialize_named_tensors(weights))
    conn.recv()  # hold them until the engine is done


def test_update_weights_from_tensor_by_cuda_ipc_with_graphs(tmp_path):
    """A trainer process on the same GPU shares its tensors by CUDA IPC handle; the engine's outputs
    then equal a fresh engine's built from that checkpoint, bitwise (graphs replayed)."""
    import multiprocessing as mp

    _, path_a, path_b = two_checkpoints(tmp_path)
    build, ps, params = checkpoint_engine, UPDATE_PROMPTS, UPDATE_PARAMS
    eng = build(path_a)
    before = eng.generate(ps, params)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_cuda_sharer, args=(path_b, theirs))
    proc.start()
    try:
        assert ours.poll(120), "the trainer process sent nothing"
        eng.update_weights_from_tensor([ours.recv()])
    finally:
        ours.send("done")
        proc.join(60)
    after = eng.generate(ps, params)
    assert not all(same(x, y) for x, y in zip(after, before))
    assert all(same(x, y) for x, y in zip(after, build(path_b).generate(ps, params)))
    assert eng.runner.main_graphs.num_replays[1] > 0


def test_sleep_releases_device_memory_and_wakes_bitwise():
    """Level 1: caches, graphs and weights leave the GPU (weights to pinned host memory); after a
    wake the graphs are captured again on first use and the outputs are the same bits."""
    eng = engine()
    ps = prompts(6, seed=7, vocab=VOCAB)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    before = eng.generate(ps, params)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    eng.runner.sleep(1)
    free1 = torch.cuda.mem_get_info()[0]
    weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    assert free1 - free0 > weights  # at least the weights came off (plus caches and graph pools)
    eng.runner.wake_up()
    after = eng.generate(ps, params)
    assert all(same(a, b) for a, b in zip(after, before))
    assert eng.runner.main_graphs.num_replays[1] > 0  # graphs were captured again and replayed


def test_routed_experts_are_batch_invariant_with_graphs():
    cfg = gpu_config("cuda_hopper_invariant", "qwen3.5-35b-a3b", layers=4, graphs=True, invariant=True)
    cfg = cfg.replace(model={"enable_return_routed_experts": True})
    ps = prompts(8, seed=8, vocab=VOCAB)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=6, ignore_eos=True, return_routed_experts=True)
    batched = build_engine(cfg).generate(ps, params)
    alone_eng = build_engine(cfg)
    for p, b in zip(ps, batched):
        a = alone_eng.generate([p], params)[0]
        assert same(a, b) and (a.routed_experts == b.routed_experts).all()
        assert b.routed_experts.shape == (len(p) + len(b.token_ids) - 1, 4, 8)
