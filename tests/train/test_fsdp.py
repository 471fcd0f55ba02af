"""The policy under ``torch.distributed.fsdp.fully_shard`` on two gloo ranks (CPU): its forward gives
the logprobs of the unsharded policy bitwise, and one optimizer step over the two ranks'
micro-batches lands where one process's step over both lands (gradients averaged)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from helpers import tiny_config

from bi_core import EngineConfig
from bi_core.train import PolicyModel

PROMPTS = [[5, 17, 200, 3, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [42, 43], [7] * 17]
COMPLETIONS = [[7, 8, 9], [1, 2, 3, 4], [3, 250, 4, 5, 6], [9, 9]]


def _config() -> EngineConfig:
    return EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": "tiny-moe", "seed": 4}, "device": "cpu", "max_model_len": 64},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": 8}))


def _loss(policy, rows) -> torch.Tensor:
    lps = policy.token_logprobs([PROMPTS[i] for i in rows], [COMPLETIONS[i] for i in rows])
    return -torch.cat(lps).mean(), lps


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    policy = PolicyModel.from_config(_config(), param_dtype=torch.float32)
    for layer in policy.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    loss, lps = _loss(policy, [rank * 2, rank * 2 + 1])
    loss.backward()
    opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in policy.named_parameters()}
    if rank == 0:
        torch.save({"params": full, "lps": [lp.detach() for lp in lps]}, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_fully_shard_on_two_gloo_ranks(tmp_path):
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_rank, args=(_free_port(), out), nprocs=2, start_method="spawn")
    got = torch.load(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' count: the reference backend's CPU rows depend on it
    try:
        _check_against_one_process(got)
    finally:
        torch.set_num_threads(threads)


def _check_against_one_process(got: dict) -> None:
    policy = PolicyModel.from_config(_config(), param_dtype=torch.float32)
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    loss0, lps = _loss(policy, [0, 1])
    for a, b in zip(lps, got["lps"]):
        assert torch.equal(a.detach(), b)  # sharded weights, the same forward bits
    ((loss0 + _loss(policy, [2, 3])[0]) / 2).backward()
    opt.step()
    for name, p in policy.named_parameters():
        torch.testing.assert_close(got["params"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(before["model.norm.weight"], policy.model.norm.weight.detach())  # the step moved it
