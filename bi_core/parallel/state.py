"""The tensor-parallel process groups of this process (one per engine process).

``device_group``: NCCL on GPUs (gloo on CPUs), for the model's collectives. ``control``: gloo,
for the lock-step commands rank 0 sends (host objects, never on the GPU's stream)."""

from __future__ import annotations

import datetime
import os

import attrs
import torch
import torch.distributed as dist

from bi_core.parallel.shard import TPInfo


@attrs.frozen
class TPGroup:
    info: TPInfo
    device_group: object
    control: object


_current: TPGroup | None = None


def current() -> TPGroup | None:
    """This process's groups, or None when tensor parallelism is off."""
    return _current


def init(rank: int, world: int, device: torch.device, port: int, timeout_s: float = 600.0) -> TPGroup:
    global _current
    if _current is not None:
        raise RuntimeError("tensor-parallel groups already initialised in this process "
                           "(one tensor-parallel engine per process)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    # NVLink SHARP reduces inside the switch with undocumented rounding: off, so that a two-rank
    # NCCL all-reduce is exactly r0 + r1 (the invariant backend relies on it; ops/collective.py).
    # A user who sets NCCL_NVLS_ENABLE=1 gets the fixed-order sum at two ranks too.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout, **kw)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    _current = TPGroup(TPInfo(rank, world), dist.group.WORLD, control)
    return _current


def shutdown() -> None:
    global _current
    if _current is not None and dist.is_initialized():
        dist.destroy_process_group()
    _current = None
