"""The messages on the pipe between the HTTP process (``client.py``) and the engine process
(``loop.py``): one frozen class per kind, pickled by the multiprocessing Connection. Each side
dispatches on the class (``match``); a message of any other type is a bug and raises
``UnexpectedMessage``.

HTTP -> engine: ``Add``, ``Abort``, ``Stop``, and the control calls (``CONTROL``: pause, sleep, weight
sync, collective RPC, ...), each with a ``key``. Engine -> HTTP: ``Ready`` or ``StartFailed`` once at start, ``Added``
or ``Refused`` per ``Add``, ``ControlDone`` or ``ControlFailed`` per control call (after the deltas
it caused), ``Out`` per loop iteration that produced anything, ``Stopped`` once at the end."""

from __future__ import annotations

import reprlib
from typing import TYPE_CHECKING, Literal

import attrs

if TYPE_CHECKING:
    from bi_core.runtime.sequence import RequestOutput, SamplingParams
    from bi_core.serve.metrics import Counts

# One stream's progress in an ``Out``: (key, choice, token_ids, logprobs, top_logprobs, text,
# output or None; output is set on the choice's last delta). A plain tuple rather than a class:
# every stream sends one per step, and a class instance each costs several times a tuple's time
# to pickle and unpickle, on the engine's and the HTTP process's critical paths.
WireDelta = tuple[int, int, list[int], list[float], list[dict[int, float]], str, "RequestOutput | None"]

# no_weights: a level-2 sleep (or a broken update) left the engine without whole weights (409)
RefusalReason = Literal["unavailable", "overloaded", "prompt_too_long", "invalid", "no_weights"]
PauseMode = Literal["abort", "wait", "keep"]  # vLLM's: abort the requests in flight, let them finish, or freeze them
# why a control call failed: a bad argument (400), the engine takes no more calls (503), or the engine
# raised anything else (500)
ControlFailure = Literal["invalid", "not_found", "unavailable", "error"]

_short = reprlib.Repr()  # an unexpected message in an error: its start
_short.maxother = _short.maxstring = 200


class UnexpectedMessage(TypeError):
    """A message the receiving side does not handle (both ends run the same code: a bug)."""

    def __init__(self, msg: object, receiver: str, expected: tuple[type, ...]) -> None:
        names = ", ".join(t.__name__ for t in expected)
        super().__init__(f"{receiver} got an unexpected message on the engine pipe, of type "
                         f"{type(msg).__qualname__}: {_short.repr(msg)} (expected one of {names})")


@attrs.frozen
class EngineInfo:
    """What the HTTP process needs to know of the engine."""

    max_model_len: int
    batch_invariant: bool
    vocab_size: int
    max_num_seqs: int
    tensor_parallel_size: int = 1
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, source) of the LoRA adapters loaded at start
    takes_images: bool = False  # the engine has a vision tower (docs/vision.md)


# ---------------------------------------------------------------------- HTTP process -> engine process


@attrs.frozen
class Add:
    """HTTP -> engine, per HTTP request: its (prompt ids, params[, decoded images]) jobs, to add together before the next step, or none."""

    key: int  # the HTTP side's id of the request, echoed in Added / Refused and in each WireDelta
    jobs: list[tuple[list[int], SamplingParams] | tuple[list[int], SamplingParams, dict]]


@attrs.frozen
class Abort:
    """HTTP -> engine, when a client went away before its request finished: abort these before the next step."""

    request_ids: list[int]


@attrs.frozen
class Stop:
    """HTTP -> engine, at shutdown: add nothing more, abort what is unfinished ``timeout_s`` from now, then end."""

    timeout_s: float


# ---------------------------------------------------------------------- control calls (HTTP -> engine)
# Each is answered by ControlDone (its value) or ControlFailed, after the deltas of the requests it ended.


@attrs.frozen
class PauseGeneration:
    """HTTP -> engine: pause generation (mode: abort, wait or keep the requests in flight); answered once paused."""

    key: int
    mode: PauseMode
    clear_cache: bool


@attrs.frozen
class ResumeGeneration:
    """HTTP -> engine: resume generation (kept requests go on, requests held while paused are added); answered after."""

    key: int


@attrs.frozen
class IsPaused:
    """HTTP -> engine: whether generation is paused; answered with a bool."""

    key: int


@attrs.frozen
class AbortRequests:
    """HTTP -> engine: abort these requests (None: all the engine has); answered with how many were aborted."""

    key: int
    request_ids: list[int] | None
    message: str | None = None  # the aborted requests' finish reason message (SGLang's abort_message)


@attrs.frozen
class ResetPrefixCache:
    """HTTP -> engine: drop the prefix cache; answered with the engine's bool (False: it did not)."""

    key: int


@attrs.frozen
class Sleep:
    """HTTP -> engine: pause (mode) unless paused, then release memory (level 1: weights to host, 2: dropped)."""

    key: int
    level: int
    mode: PauseMode


@attrs.frozen
class WakeUp:
    """HTTP -> engine: restore the tagged memory (None: all); fully awake, generation resumes if Sleep paused it."""

    key: int
    tags: list[str] | None


@attrs.frozen
class IsSleeping:
    """HTTP -> engine: whether any memory is released; answered with a bool."""

    key: int


@attrs.frozen
class GetWeightVersion:
    """HTTP -> engine: the engine's weight version; answered with an int."""

    key: int


@attrs.frozen
class InitWeightsUpdateGroup:
    """HTTP -> engine: join the trainer's process group (in a thread: the loop steps on); answered once joined, or not."""

    key: int
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str | None


@attrs.frozen
class UpdateWeightsFromDistributed:
    """HTTP -> engine: receive these tensors from the trainer's broadcast; answered with the count and new version."""

    key: int
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    flush_cache: bool
    weight_version: int | None
    abort_all: bool  # abort every unfinished request first


@attrs.frozen
class UpdateWeightsFromTensor:
    """HTTP -> engine: copy in the tensors these payloads share (``rl.serialize_named_tensors``); answered with the count and new version."""

    key: int
    payloads: list[str]
    load_format: str | None
    flush_cache: bool
    weight_version: int | None
    abort_all: bool  # abort every unfinished request first


@attrs.frozen
class DestroyWeightsUpdateGroup:
    """HTTP -> engine: leave the trainer's process group; answered after."""

    key: int
    group_name: str


@attrs.frozen
class UpdateWeightsFromDisk:
    """HTTP -> engine: load weights from a checkpoint directory; answered with {num_tensors, weight_version}."""

    key: int
    path: str
    abort_all: bool  # abort unfinished requests (else they make the update fail)


@attrs.frozen
class LoadLoraAdapter:
    """HTTP -> engine: load a PEFT adapter directory as ``name`` (load_inplace: its next version); answered with {name, version, slot}."""

    key: int
    name: str
    path: str
    load_inplace: bool


@attrs.frozen
class LoadLoraAdapterFromTensor:
    """HTTP -> engine: load the adapter a payload shares (rl.serialize_named_tensors) as ``name``'s next version; answered as LoadLoraAdapter."""

    key: int
    name: str
    payload: str
    config: dict


@attrs.frozen
class UnloadLoraAdapter:
    """HTTP -> engine: stop serving adapter ``name``; answered with {name, version}."""

    key: int
    name: str


@attrs.frozen
class CollectiveRpc:
    """HTTP -> engine (dev mode): call a worker method on every tensor-parallel rank; answered with the results in rank order."""

    key: int
    method: str
    args: list[str]
    kwargs: dict[str, str]
    timeout: float | None


# ---------------------------------------------------------------------- engine process -> HTTP process


@attrs.frozen
class Ready:
    """Engine -> HTTP, once at start: the engine is built and warmed up; the loop runs."""

    info: EngineInfo


@attrs.frozen
class StartFailed:
    """Engine -> HTTP, once at start instead of Ready: building the engine failed, and why."""

    message: str


@attrs.frozen
class Added:
    """Engine -> HTTP, per accepted Add: the request ids of its choices (each job's ``n`` samples, in order)."""

    key: int
    request_ids: list[int]
    weight_version: int = 0  # the engine's weights when it added them


@attrs.frozen
class Refused:
    """Engine -> HTTP, per refused Add (nothing of it was added): the reason's kind and a message for the client."""

    key: int
    reason: RefusalReason
    message: str


@attrs.frozen
class Out:
    """Engine -> HTTP, per loop iteration that produced anything: every stream's delta, metric counts, engine failure."""

    deltas: list[WireDelta]
    counts: Counts
    failure: str | None  # set once a step raised: the engine may be unusable
    status: dict | None = None  # what /health reports of the engine (weights, weight-update groups), when it changed


@attrs.frozen
class ControlDone:
    """Engine -> HTTP, per control call done: its value (JSON-able), sent after the deltas of what it ended."""

    key: int
    value: object


@attrs.frozen
class ControlFailed:
    """Engine -> HTTP, per control call that failed: why (the HTTP status's kind) and a message for the client."""

    key: int
    reason: ControlFailure
    message: str


@attrs.frozen
class Stopped:
    """Engine -> HTTP, last: the loop ended (after Stop, or the pipe closed) and the engine is closed."""


CONTROL = (PauseGeneration, ResumeGeneration, IsPaused, AbortRequests, ResetPrefixCache, Sleep, WakeUp, IsSleeping,
           GetWeightVersion, InitWeightsUpdateGroup, UpdateWeightsFromDistributed, DestroyWeightsUpdateGroup,
           UpdateWeightsFromDisk, UpdateWeightsFromTensor, CollectiveRpc, LoadLoraAdapter, LoadLoraAdapterFromTensor,
           UnloadLoraAdapter)
TO_ENGINE = (Add, Abort, Stop, *CONTROL)
FROM_ENGINE = (Ready, StartFailed, Added, Refused, ControlDone, ControlFailed, Out, Stopped)
