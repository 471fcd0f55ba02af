"""Lock-step tensor parallelism: one engine per GPU, all running the same deterministic schedule.

Rank 0 is the user's process (Python API, CLI, server); it starts ranks 1..N-1 itself (spawned
processes, ``launch``: what each runs is passed in by the composition root, ``runtime/launch.py``,
which builds the rank's engine and replays the calls there). Every rank builds the same engine with its own shard of the weights
and its own KV cache / GDN states (its heads only). Rank 0 records each request-changing call
(``add_request``, ``add_score_request``, ``abort``) and, at each ``step``, sends the calls since
the last step plus the step itself to the other ranks over a gloo group; they replay them in the
same order. Scheduling is a pure function of those calls and of the sampled tokens, and the
sampled tokens are the same on every rank (the logits are gathered whole to every rank and
sampled with the same keys), so every rank makes the same decisions and issues the same
collectives without any per-step plan being shipped. What travels is typed (``AddRequest``,
``AddScoreRequest``, ``Abort``, ``Step``, ``UpdateWeightsFromPath``, ``ReceiveWeights``,
``ResetPrefixCache``, ``HoldAdmissions``/``ReleaseAdmissions`` around a pause's drain, ``Sleep``,
``WakeUp``, the
weight-sync calls ``InitWeightsUpdateGroup``/``UpdateWeightsFromTrainer``/
``DestroyWeightsUpdateGroup``, ``CollectiveRpc``, ``Shutdown``): the scheduler's intake plus the
step, never engine method names (``CollectiveRpc`` names a method of the rank's worker, ``rl/collective_rpc.py``;
every rank answers it to rank 0 over the control group). This is SGLang's arrangement (a scheduler
per TP rank, requests broadcast from rank 0); it keeps AR, MTP, n-sample forks, prefix caching
and scoring working unchanged under TP. Each step also carries rank 0's step count and request
counters, so a rank that drifted stops with an error instead of deadlocking silently."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable

import attrs
import torch
import torch.distributed as dist

from bi_core.errors import BiEngineError
from bi_core.parallel import state
from bi_core.ports import free_port


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of ``rank``: consecutive GPUs from the configured one (CPU stays CPU)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


@attrs.frozen
class AddRequest:
    """``LLMEngine.add_request`` on rank 0."""

    prompt: object
    params: object
    text: bool


@attrs.frozen
class AddScoreRequest:
    """``LLMEngine.add_score_request`` on rank 0."""

    prompt: object
    continuation: object
    exact: bool
    logprobs: int


@attrs.frozen
class Abort:
    """``LLMEngine.abort`` on rank 0."""

    request_id: int


@attrs.frozen
class Step:
    """Run one step; ``check``: rank 0's (steps run, next request id, requests) before it."""

    check: tuple[int, int, int]


@attrs.frozen
class UpdateWeightsFromPath:
    """``update_weights(path)`` on rank 0, checked there: each rank reads its shard."""

    path: str


@attrs.frozen
class ReceiveWeights:
    """``update_weights(tensors)`` on rank 0, checked there: the tensors follow over the device group."""

    meta: list[tuple[str, tuple[int, ...], torch.dtype]]


@attrs.frozen
class ResetPrefixCache:
    """``LLMEngine.reset_prefix_cache`` on rank 0 (also ``pause_generation(clear_cache=True)``)."""


@attrs.frozen
class HoldAdmissions:
    """``pause_generation(mode='wait')`` on rank 0 starts draining: queued requests not started are held back."""


@attrs.frozen
class ReleaseAdmissions:
    """The drain is over: the held requests are queued again."""


@attrs.frozen
class Sleep:
    """``LLMEngine.sleep`` on rank 0, checked there: every rank releases its memory."""

    level: int


@attrs.frozen
class WakeUp:
    """``LLMEngine.wake_up`` on rank 0."""

    tags: tuple[str, ...] | None


@attrs.frozen
class InitWeightsUpdateGroup:
    """``init_weights_update_group`` on rank 0, checked there: every rank joins the trainer's group."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float


@attrs.frozen
class UpdateWeightsFromTrainer:
    """``update_weights_from_distributed`` on rank 0: every rank checks, takes part in the handshake
    and receives the buckets from the trainer (not from rank 0)."""

    names: list
    dtypes: list
    shapes: list
    group_name: str
    flush_cache: bool
    weight_version: int | None


@attrs.frozen
class DestroyWeightsUpdateGroup:
    """``destroy_weights_update_group`` on rank 0."""

    group_name: str


@attrs.frozen
class CollectiveRpc:
    """``LLMEngine.collective_rpc`` on rank 0, checked there: every rank runs the method and answers (``gather``)."""

    method: str
    args: tuple
    kwargs: dict


@attrs.frozen
class Shutdown:
    """Rank 0's engine is closing."""


Message = (AddRequest | AddScoreRequest | Abort | Step | UpdateWeightsFromPath | ReceiveWeights | ResetPrefixCache
           | HoldAdmissions | ReleaseAdmissions | Sleep | WakeUp | InitWeightsUpdateGroup | UpdateWeightsFromTrainer
           | DestroyWeightsUpdateGroup | CollectiveRpc | Shutdown)


class Driver:
    """Rank 0's side: the worker processes and the calls not yet sent to them."""

    def __init__(self, procs: list, group: state.TPGroup) -> None:
        self.procs, self.group = procs, group
        self.pending: list[Message] = []
        self.started = False  # every rank built its engine and listens for calls
        self.closed = False

    def record(self, message: Message) -> None:
        """Send ``message`` with the next step."""
        self.pending.append(message)

    def send_now(self, message: Message) -> None:
        """Send the pending messages and ``message`` now."""
        dead = [(i + 1, p.exitcode) for i, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            raise BiEngineError(f"tensor-parallel rank(s) {', '.join(f'{r} (exit code {c})' for r, c in dead)} "
                                "stopped; the engine cannot go on")
        cmds, self.pending = self.pending + [message], []
        dist.broadcast_object_list([cmds], src=0, group=self.group.control)

    def send_update(self, source, names: list[str], device: torch.device) -> None:
        """``update_weights`` on rank 0, checked there: a checkpoint path (``source`` a str: each
        rank reads its shard), or tensors: their names, shapes and dtypes first, then each tensor
        broadcast from rank 0 over the device group (NCCL on GPUs), one at a time."""
        if isinstance(source, str):
            self.send_now(UpdateWeightsFromPath(source))
            return
        self.send_now(ReceiveWeights([(n, source.shape(n), source.dtype(n)) for n in names]))
        for n in names:
            dist.broadcast(source.get(n).to(device).contiguous(), src=0, group=self.group.device_group)

    def gather(self, mine: object) -> list:
        """Every rank's answer to the message just sent (``answer`` on the others), in rank order:
        ``mine`` first (it stays here: never pickled)."""
        box: list = [None] * (len(self.procs) + 1)
        dist.gather_object(None, box, dst=0, group=self.group.control)
        return [mine, *box[1:]]

    def close(self, timeout_s: float = 30.0) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.started and all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([[Shutdown()]], src=0, group=self.group.control)
            else:  # rank 0 failed while building: the others may wait in a collective, stop them
                timeout_s = 0.0
        finally:
            for p in self.procs:
                p.join(timeout_s)
                if p.is_alive():
                    p.terminate()
            state.shutdown()


def launch(config, device: torch.device, rank_main: Callable[[int, object, int, str], None]) -> Driver:
    """Start ranks 1..N-1, each a spawned process running ``rank_main(rank, config, port, device)``
    (a module-level function: ``bi_core.runtime.launch.rank_main`` builds that rank's engine and
    replays rank 0's calls), and join the process groups as rank 0."""
    world = config.parallel.tensor_parallel_size
    if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
        from bi_core.errors import ConfigError

        raise ConfigError("parallel.tensor_parallel_size", f"{world} ranks from {device} need "
                          f"{(device.index or 0) + world} GPUs; this machine has {torch.cuda.device_count()}")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(rank, config, port, str(device)), daemon=True,
                         name=f"bi-engine-tp{rank}") for rank in range(1, world)]
    for p in procs:
        p.start()
    group = state.init(0, world, rank_device(device, 0), port)
    return Driver(procs, group)


def answer(value: object) -> None:
    """This rank's answer to the message just replayed, gathered by rank 0 (``Driver.gather``)."""
    dist.gather_object(value, None, dst=0, group=state.current().control)


def receive_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The next tensor rank 0's ``send_weights`` broadcasts."""
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(t, src=0, group=state.current().device_group)
    return t


def receive_calls(group: state.TPGroup) -> list[Message]:
    """The calls rank 0 sends next (``Driver.send_now``), on ranks 1..N-1: they wait here."""
    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=group.control)
    return box[0]
