"""The composition root of an engine: ``build_engine`` builds rank 0 and, under tensor parallelism,
starts ranks 1..N-1 (``parallel/lockstep.py``), each of which builds the same engine here
(``rank_main``) and replays rank 0's calls on it (``replay``). The one module that knows both
the engine and the lock-step: neither imports the other's side."""

from __future__ import annotations

import logging

import torch

from bi_core.config import EngineConfig
from bi_core.errors import BiEngineError
from bi_core.models.loader import TensorDict, update_weights
from bi_core.parallel import lockstep, state
from bi_core.parallel.lockstep import (
    Abort,
    AddRequest,
    AddScoreRequest,
    CollectiveRpc,
    DestroyWeightsUpdateGroup,
    HoldAdmissions,
    InitWeightsUpdateGroup,
    Message,
    ReceiveWeights,
    ReleaseAdmissions,
    ResetPrefixCache,
    Shutdown,
    Sleep,
    Step,
    UpdateWeightsFromPath,
    UpdateWeightsFromTrainer,
    WakeUp,
)
from bi_core.registry import Registry
from bi_core.rl.collective_rpc import run_method, sendable
from bi_core.runtime.engine import LLMEngine

log = logging.getLogger(__name__)


def build_engine(config: EngineConfig, registry: Registry | None = None) -> LLMEngine:
    """Rank 0's engine; with ``parallel.tensor_parallel_size`` N > 1 it starts the other N - 1 ranks."""
    return LLMEngine(config, registry, start_ranks=start_ranks)


def start_ranks(config: EngineConfig, device: torch.device) -> lockstep.Driver:
    """Ranks 1..N-1 of a tensor-parallel engine, each running ``rank_main``; rank 0 drives them."""
    return lockstep.launch(config, device, rank_main)


def rank_main(rank: int, config: EngineConfig, port: int, device: str) -> None:
    """Rank ``rank``: build the same engine, then replay rank 0's calls until told to stop."""
    logging.basicConfig(level=logging.WARNING, format=f"[tp{rank}] %(levelname)s %(name)s: %(message)s")
    world = config.parallel.tensor_parallel_size
    group = state.init(rank, world, lockstep.rank_device(torch.device(device), rank), port)
    engine = LLMEngine(config, tp_rank=rank)
    try:
        while True:
            for message in lockstep.receive_calls(group):
                if not replay(engine, message, rank):
                    return
    finally:
        state.shutdown()


def replay(engine, message: Message, rank: int) -> bool:
    """Apply one of rank 0's messages to this rank's engine; False at shutdown."""
    match message:
        case AddRequest(prompt, params, text):
            engine.add_request(prompt, params, text=text)
        case AddScoreRequest(prompt, continuation, exact, logprobs):
            engine.add_score_request(prompt, continuation, exact=exact, logprobs=logprobs)
        case Abort(request_id):
            engine.abort(request_id)
        case Step(check):
            mine = engine.lockstep_check()
            if check != mine:
                raise BiEngineError(f"tensor-parallel rank {rank} drifted from rank 0: "
                                    f"(steps, next request id, requests) {mine} != {check}")
            engine.step()
        case UpdateWeightsFromPath(path):
            engine.update_weights(path)
        case ReceiveWeights(meta):  # one tensor at a time, each into this rank's shard
            for name, shape, dtype in meta:
                tensor = lockstep.receive_tensor(shape, dtype, engine.device)
                update_weights(engine.model, TensorDict([(name, tensor)]))
            engine.after_weight_update()
        case ResetPrefixCache():
            engine.reset_prefix_cache()
        case HoldAdmissions():
            engine.rollout.hold_admissions()
        case ReleaseAdmissions():
            engine.rollout.release_admissions()
        case Sleep(level):
            engine.sleep(level)
        case WakeUp(tags):
            engine.wake_up(None if tags is None else list(tags))
        case InitWeightsUpdateGroup() | UpdateWeightsFromTrainer() | DestroyWeightsUpdateGroup():
            weight_sync(engine, message, rank)
        case CollectiveRpc(method, args, kwargs):  # a method that fails answers its error: rank 0 reports it
            lockstep.answer(sendable(run_method(engine.worker, method, args, kwargs)))
        case Shutdown():
            return False
        case _:
            raise BiEngineError(f"tensor-parallel rank {rank}: unexpected message from rank 0: {message!r}")
    return True


def weight_sync(engine, message: Message, rank: int) -> None:
    """A weight-sync call on this rank. Its failure is logged and the lock-step goes on: rank 0
    raises its own (a refusal is the same on every rank; a transfer that fails on one rank fails
    the confirmation on all, and rank 0 then refuses requests until a complete update lands)."""
    try:
        match message:
            case InitWeightsUpdateGroup(address, port, offset, world, name, backend, timeout_s):
                # joined in a thread (rank 0 steps on meanwhile, so must this rank); an update waits for it
                engine.init_weights_update_group(address, port, offset, world, name, backend, timeout_s, wait=False)
            case UpdateWeightsFromTrainer(names, dtypes, shapes, name, flush_cache, version):
                engine.update_weights_from_distributed(names, dtypes, shapes, name, flush_cache, version)
            case DestroyWeightsUpdateGroup(name):
                engine.destroy_weights_update_group(name)
    except BiEngineError as e:  # a refusal (a RequestError, CheckpointError) is rank 0's to report
        log.log(logging.WARNING if type(e) is BiEngineError else logging.INFO, "tensor-parallel rank %d: %s", rank, e)
