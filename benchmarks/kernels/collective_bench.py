"""The invariant all-reduce's cost against NCCL's, per call, on N GPUs of one host.

    python3 benchmarks/kernels/collective_bench.py [N] [--hidden 2048]

For rows in 1, 8, 64, 256 (bf16, ``hidden`` columns, the model's all-reduce sizes at decode):
microseconds per call of ``all_reduce_fixed_order`` and of NCCL's ``all_reduce``, each captured 50
times in a CUDA graph and replayed (how decode steps run them), and whether NCCL's result equals
the fixed-order one at that size."""

from __future__ import annotations

import argparse
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bi_core.parallel.collectives import all_reduce_fixed_order

CALLS = 50


def _time_graph(fn, x: torch.Tensor) -> float:
    """Microseconds per call of ``fn(x)``, replaying a graph of CALLS calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def _run(rank: int, world: int, port: int, hidden: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    rows_out = []
    for rows in (1, 8, 64, 256):
        x = torch.randn(rows, hidden, device="cuda").bfloat16()
        fixed = _time_graph(lambda t: all_reduce_fixed_order(t, group, world), x)
        nccl = _time_graph(lambda t: dist.all_reduce(t.clone(), group=group), x)
        ref = all_reduce_fixed_order(x, group, world)
        y = x.clone()
        dist.all_reduce(y)
        rows_out.append((rows, fixed, nccl, torch.equal(y, ref)))
    if rank == 0:
        print(f"{world} GPUs, bf16 x {hidden}: us per call (CUDA graph of {CALLS} calls)")
        print("rows | fixed-order | NCCL all_reduce (incl. a copy) | NCCL == fixed-order")
        for rows, fixed, nccl, same in rows_out:
            print(f"{rows:4d} | {fixed:11.1f} | {nccl:30.1f} | {same}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("world", nargs="?", type=int, default=torch.cuda.device_count())
    ap.add_argument("--hidden", type=int, default=2048)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run, args=(a.world, port, a.hidden), nprocs=a.world)


if __name__ == "__main__":
    main()
