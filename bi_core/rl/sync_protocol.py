"""Weight sync from a trainer: the protocol both sides follow (``bi_core.rl.WeightSender`` on the
trainer, ``LLMEngine.update_weights_from_distributed`` on every engine rank). SGLang's names.

The group. ``WeightSender(master_address, master_port, world_size)`` on the trainer and
``engine.init_weights_update_group(master_address, master_port, rank_offset, world_size)`` on the
engine build a torch.distributed process group of their own: a ``TCPStore`` the trainer hosts at
``master_address:master_port`` (keys prefixed by the group name) and a ``ProcessGroupGloo`` (CPU)
or ``ProcessGroupNCCL`` (GPU) built on it directly, never the default group (the engine's
tensor-parallel ranks use that one). The trainer is rank 0; engine rank r (tensor parallel) is
``rank_offset + r``; several engines may share one group at different offsets. Both calls block
until every member has joined (at most ``timeout_s``); the engine's rendezvous runs in a thread
(``joining.py``), so a server steps on meanwhile and answers the call when it ends.

One update (``WeightSender.send``):

1. The trainer starts ``request_update(names, dtypes, shapes)`` in a thread: whatever makes the
   engine call ``update_weights_from_distributed(names, dtypes, shapes)`` (a direct call, an HTTP
   POST). ``dtypes`` are names (``"bfloat16"``), ``shapes`` lists of ints: JSON as they are.
2. Every engine rank checks the metadata against its model before anything is received: names
   (Hugging Face's or the engine's own), shapes and dtypes by ``update_weights``' rules, and that
   no request has started (see ``bi_core.rl.receiver``).
3. Handshake: one all-gather of a row ``[status, bucket_bytes, fingerprint]`` from every member.
   ``status`` 0 = go (an engine rank that refused puts 1); the trainer puts its bucket size (the
   engines 0); every member puts ``fingerprint(names, dtypes, shapes)`` of the metadata as it got
   it. Every member then decides alike: go iff every status is 0 and every fingerprint is the
   trainer's. On no-go each side raises (the engine its reason, the trainer the error its
   ``request_update`` call got) and nothing was sent or changed: a refused update never leaves
   the trainer blocked in a broadcast.
4. The tensors, in the order given, packed into buckets by ``bucket_layout`` (flat uint8 buffers
   of at most ``bucket_bytes``, each tensor at a 16-byte aligned offset, a tensor larger than
   that alone in its bucket): one broadcast from rank 0 per bucket. Both sides derive the layout
   from the metadata and the trainer's bucket size, so nothing else travels. Each engine rank
   copies a bucket into its model as it lands (its own shard of every full tensor).
5. Confirmation: an all-reduce (max) of every member's status (0 = every bucket was applied). The
   engine's call then returns the number of tensors copied; ``send`` returns what
   ``request_update`` returned.

Every collective runs under the group's timeout; a failure or a timeout is a ``BiEngineError``
naming the stage, e.g. ``receiving bucket 3 of 7 from the trainer: timed out after 300 s``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as dist

from bi_core.errors import BiEngineError, RequestError

ALIGN = 16  # bytes: every tensor's offset in a bucket, so that its bytes can be viewed as any dtype
GO, REFUSED = 0, 1
BACKENDS = ("gloo", "nccl")
ABANDON_GRACE_S = 2.0  # a handshake the other side answered just before giving up is still taken


# ------------------------------------------------------------------ metadata


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (how dtypes travel)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """A dtype from its name (``"bfloat16"``, ``"torch.bfloat16"``) or itself; RequestError otherwise."""
    if isinstance(value, torch.dtype):
        return value
    found = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(found, torch.dtype):
        raise RequestError(f"unknown dtype {value!r} (expected a torch dtype name such as 'bfloat16' or 'float32')")
    return found


def parse_shape(value) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                       for d in value):
        raise RequestError(f"shape {value!r} is not a list of non-negative ints")
    return tuple(value)


def fingerprint(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> int:
    """A signed 64-bit hash of the metadata (the handshake compares it across members)."""
    text = json.dumps([list(names), [dtype_name(d) for d in dtypes], [list(s) for s in shapes]])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@attrs.frozen
class Bucket:
    """One broadcast: ``entries`` are (tensor index, byte offset, byte count); ``size`` in bytes."""

    entries: tuple[tuple[int, int, int], ...]
    size: int


def bucket_layout(sizes: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """Tensors of ``sizes`` bytes, in order, packed into buckets of at most ``bucket_bytes`` (a
    larger tensor alone in its own), each at an ``ALIGN``-byte aligned offset."""
    if bucket_bytes < 1:
        raise BiEngineError(f"bucket size must be at least 1 byte, got {bucket_bytes}")
    buckets, entries, end = [], [], 0
    for i, n in enumerate(sizes):
        offset = -(-end // ALIGN) * ALIGN
        if entries and offset + n > bucket_bytes:
            buckets.append(Bucket(tuple(entries), end))
            entries, offset = [], 0
        entries.append((i, offset, n))
        end = offset + n
    if entries:
        buckets.append(Bucket(tuple(entries), end))
    return buckets


def view(buf: torch.Tensor, offset: int, size: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor at ``offset`` of a bucket's bytes."""
    return buf[offset:offset + size].view(dtype).view(tuple(shape))


def no_go(rows: list[list[int]]) -> str | None:
    """Why the handshake's rows say no (the same answer on every member), or None: go."""
    refused = [rank for rank, row in enumerate(rows) if row[0] != GO]
    if refused:
        return f"refused by rank(s) {refused} of the group"
    differ = [rank for rank, row in enumerate(rows) if row[2] != rows[0][2]]
    if differ:
        return (f"rank(s) {differ} of the group were asked for other names, dtypes or shapes than the trainer "
                "sends (request_update must pass send's metadata on unchanged)")
    return None


# ------------------------------------------------------------------ the group


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """None: nccl for CUDA devices, gloo otherwise."""
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in BACKENDS:
        raise RequestError(f"weight-update backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        raise RequestError(f"weight-update backend 'nccl' needs CUDA devices and a torch build with NCCL "
                           f"(this process runs on {device}); use backend='gloo'")
    return backend


def _reason(e: BaseException, timeout_s: float) -> str:
    """A collective's error in a few words (gloo's own carry a source path and advice)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". This is typically")[0]
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        return f"timed out after {timeout_s:g} s"
    if any(k in low for k in ("closed by peer", "connection reset", "broken pipe", "read error", "refused")):
        return f"a member of the group went away ({text})"
    return text


def _completes(work, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while not work.is_completed():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


@contextlib.contextmanager
def _nccl_waits_raise():
    """While an NCCL group is built: its ``wait()`` blocks the host and raises on a timeout
    (TORCH_NCCL_BLOCKING_WAIT), and a failed collective aborts its communicator without ending
    the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=2), so a dead trainer is an error, not an exit.
    The engine's own groups, built before, keep their settings."""
    saved = {k: os.environ.get(k) for k in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
    os.environ.update(TORCH_NCCL_BLOCKING_WAIT="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="2")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


class WeightGroup:
    """This process's membership of a weight-update group: collectives that end in a BiEngineError
    naming the stage (a failure, or no answer within ``timeout_s``)."""

    def __init__(self, name: str, master_address: str, master_port: int, rank: int, world_size: int,
                 backend: str, device: torch.device, timeout_s: float) -> None:
        self.name, self.rank, self.world_size, self.backend = name, rank, world_size, backend
        self.timeout_s = timeout_s
        self.device = device if backend == "nccl" else torch.device("cpu")  # where the buckets land
        timeout = datetime.timedelta(seconds=timeout_s)
        stage = (f"joining weight-update group '{name}' at {master_address}:{master_port} as rank {rank} of "
                 f"{world_size}")
        try:
            store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                                  wait_for_workers=False)
            self._store = dist.PrefixStore(name, store)
            if backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                with _nccl_waits_raise():
                    self.pg = dist.ProcessGroupNCCL(self._store, rank, world_size, options)
            else:
                self.pg = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)
        except (RuntimeError, ValueError, OSError) as e:
            raise BiEngineError(f"{stage}: {_reason(e, timeout_s)}") from None

    def _wait(self, work, stage: str, abandon: Callable[[], str | None] | None = None) -> None:
        """Wait for ``work``; ``abandon`` (polled meanwhile) returns a reason to stop waiting."""
        try:
            if abandon is not None:
                while not work.is_completed():
                    why = abandon()
                    if why is not None and not _completes(work, ABANDON_GRACE_S):  # it may be landing now
                        raise BiEngineError(f"{stage}: {why}")
                    time.sleep(0.005)
            work.wait()
            if self.backend == "nccl":
                torch.cuda.current_stream(self.device).synchronize()
        except RuntimeError as e:
            raise BiEngineError(f"{stage}: {_reason(e, self.timeout_s)}") from None

    def handshake(self, row: Sequence[int], abandon=None) -> list[list[int]]:
        """Every member's ``[status, bucket_bytes, fingerprint]`` row, in rank order."""
        mine = torch.tensor(list(row), dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._wait(self.pg.allgather([rows], [mine]), "handshake with the other members of weight-update group "
                   f"'{self.name}'", abandon)
        return [r.tolist() for r in rows]

    def broadcast(self, buf: torch.Tensor, stage: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self.pg.broadcast([buf], opts), stage)

    def confirm(self, status: int) -> int:
        """The largest status of every member (0: every member applied every bucket)."""
        t = torch.tensor([status], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._wait(self.pg.allreduce([t], opts), f"confirming the update in weight-update group '{self.name}'")
        return int(t.item())

    def close(self) -> None:
        """Leave the group (its collectives can no longer be used)."""
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and self.backend == "nccl":
            pg.abort()  # a member that died may leave NCCL waiting; the communicator is torn down
        self._store = None
