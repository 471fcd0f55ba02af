"""The messages on the pipe between the HTTP process (``client.py``) and the engine process
(``loop.py``): one frozen class per kind, pickled by the multiprocessing Connection. Each side
dispatches on the class (``match``); a message of any other type is a bug and raises
``UnexpectedMessage``.

HTTP -> engine: ``Add``, ``Abort``, ``Stop``. Engine -> HTTP: ``Ready`` or ``StartFailed`` once at
start, ``Added`` or ``Refused`` per ``Add``, ``Out`` per loop iteration that produced anything,
``Stopped`` once at the end."""

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

RefusalReason = Literal["unavailable", "overloaded", "prompt_too_long", "invalid"]

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


# ---------------------------------------------------------------------- HTTP process -> engine process


@attrs.frozen
class Add:
    """HTTP -> engine, per HTTP request: its (prompt ids, params) jobs, to add together before the next step, or none."""

    key: int  # the HTTP side's id of the request, echoed in Added / Refused and in each WireDelta
    jobs: list[tuple[list[int], SamplingParams]]


@attrs.frozen
class Abort:
    """HTTP -> engine, when a client went away before its request finished: abort these before the next step."""

    request_ids: list[int]


@attrs.frozen
class Stop:
    """HTTP -> engine, at shutdown: add nothing more, abort what is unfinished ``timeout_s`` from now, then end."""

    timeout_s: float


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


@attrs.frozen
class Stopped:
    """Engine -> HTTP, last: the loop ended (after Stop, or the pipe closed) and the engine is closed."""


TO_ENGINE = (Add, Abort, Stop)
FROM_ENGINE = (Ready, StartFailed, Added, Refused, Out, Stopped)
