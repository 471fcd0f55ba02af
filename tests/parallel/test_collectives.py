"""The invariant all-reduce on simulated ranks (gloo, one process per rank, CPU): a row's sum is
bitwise independent of how many rows the message carries, while the library's all-reduce is not
once there are more than two ranks (negative control); with two ranks both are (a + b commutes)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bi_core.parallel.collectives import all_gather_last_dim, all_reduce_fixed_order

ROWS = (1, 2, 3, 16, 63, 64, 255, 256)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(rank: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(max(ROWS), 512, generator=g) * torch.logspace(-3, 3, 512)).to(dtype)


def _check(rank: int, world: int, port: int, dtype: torch.dtype, expect_library_varies: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = _rows(rank, dtype)
        fixed, library = {}, {}
        for n in ROWS:
            fixed[n] = all_reduce_fixed_order(rows[:n].clone(), dist.group.WORLD, world)
            x = rows[:n].clone()
            dist.all_reduce(x)
            library[n] = x
        everyone = [_rows(r, dtype).float() for r in range(world)]
        want = everyone[0]
        for r in range(1, world):
            want = want + everyone[r]  # rank order, in float32, rounded once
        for n in ROWS:
            assert torch.equal(fixed[n], want[:n].to(dtype)), f"fixed-order sum of {n} rows is not r0 + r1 + ..."
        varies = [n for n in ROWS if not torch.equal(library[n][0], library[1][0])]
        if expect_library_varies:
            assert varies, "negative control: the library all-reduce gave row 0 the same bits at every size"
        else:
            assert not varies, f"two ranks: a + b should not depend on the message size ({varies})"
            for n in ROWS:  # what the invariant backend's PairAllReduce relies on
                assert torch.equal(library[n], want[:n].to(dtype)), f"two ranks: library sum of {n} rows is not r0 + r1"
        gathered = all_gather_last_dim(rows[:3, rank * 8:(rank + 1) * 8].contiguous(), dist.group.WORLD, world)
        whole = torch.cat([_rows(r, dtype)[:3, r * 8:(r + 1) * 8] for r in range(world)], dim=1)
        assert torch.equal(gathered, whole), "all_gather_last_dim: rank r's columns belong at [r*n, (r+1)*n)"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_order_all_reduce_is_size_independent(world, dtype):
    mp.spawn(_check, args=(world, _port(), dtype, world > 2), nprocs=world)


def test_invariant_backend_uses_the_library_all_reduce_at_two_ranks_only(monkeypatch):
    """Two ranks with NVLS off: NCCL's all-reduce (a + b commutes); 4 ranks, or NVLS on: fixed order."""
    from bi_core.backends.cuda_hopper_invariant.builders import InvariantAllReduceBuilder
    from bi_core.ops.collective import CollectiveSpec, FixedOrderAllReduce, PairAllReduce
    from bi_core.parallel import state
    from bi_core.parallel.shard import TPInfo

    monkeypatch.setattr(state, "_current", state.TPGroup(TPInfo(0, 2), object(), object()))
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)

    def built(world):
        return InvariantAllReduceBuilder().build(CollectiveSpec(dtype=torch.bfloat16, device=torch.device("cpu"),
                                                                world_size=world))

    assert type(built(2)) is PairAllReduce
    assert type(built(4)) is FixedOrderAllReduce
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert type(built(2)) is FixedOrderAllReduce
