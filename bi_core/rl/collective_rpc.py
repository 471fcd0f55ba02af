"""``LLMEngine.collective_rpc`` (vLLM's): one method, by name, called on every tensor-parallel rank's
worker, the results back in rank order. A trainer uses it to check that a weight sync landed on
every rank (``weight_version``, ``weight_checksum``) or to run code of its own on each rank
(``parallel.worker_extension_cls``, vLLM's ``worker_extension_cls``: a class whose methods are mixed
into the worker).

Tensor parallel: rank 0 checks the method exists, sends ``lockstep.CollectiveRpc`` to the other ranks
(between steps, like every lock-step call), runs its own and gathers theirs over the control group.
Every rank answers, a failed method included (``Outcome.error``), so a method that raises on one rank
leaves the lock-step intact. A method runs where the engine is between steps, on every rank at once:
it may use the tensor-parallel group's collectives (every rank calls them), and must not change what
the scheduler does differently on different ranks.

A running method cannot be interrupted, so ``timeout`` is checked when every rank has answered: a
call that took longer is an error and its results are dropped (vLLM's caller also stops waiting
while its workers run on)."""

from __future__ import annotations

import importlib
import pickle
import time
from collections.abc import Callable, Mapping

import attrs
import torch

from bi_core.errors import CollectiveRpcError, ConfigError, RequestError
from bi_core.parallel import lockstep

EXTENSION_KEY = "parallel.worker_extension_cls"


class RankWorker:
    """What ``collective_rpc`` calls methods of, one per rank: the built-ins below and those of
    ``parallel.worker_extension_cls``, with ``self.engine``, ``rank``, ``world_size``, ``model``, ``device``."""

    def __init__(self, engine) -> None:
        self.engine, self.model, self.device = engine, engine.model, engine.device
        self.rank, self.world_size = engine.tp.rank, engine.tp.world

    def report_device_id(self) -> str:
        """This rank's device, e.g. ``cuda:1`` or ``cpu`` (vLLM's name; vLLM answers the GPU's UUID)."""
        return str(self.device)

    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def weight_checksum(self) -> float:
        """The float64 sum of every element of this rank's parameters: did a sync change them on
        every rank? Under tensor parallelism each rank sums its own shards (ranks differ)."""
        self.engine.rollout.refuse_if_asleep("weight_checksum", "weights")
        sums = [(p.detach().float() if p.element_size() == 1 else p.detach()).sum(dtype=torch.float64)
                for p in self.model.parameters()]  # FP8 through float32: not every device sums FP8
        return float(torch.stack(sums).sum()) if sums else 0.0


_RESERVED = ("engine", "model", "device", "rank", "world_size")  # set per instance, not on the class


def public_names(cls: type) -> set[str]:
    return {n for c in cls.__mro__[:-1] for n in vars(c) if not n.startswith("_")}


def worker_class(path: str | None) -> type[RankWorker]:
    """``RankWorker`` with the extension class at ``path`` mixed in (None: without); a ConfigError
    naming the key when it cannot be imported, is no class, or redefines a worker name."""
    if path is None:
        return RankWorker
    module_name, _, name = path.rpartition(":" if ":" in path else ".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(EXTENSION_KEY, f"cannot import module {module_name!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the module's own code failed: one line naming it
        raise ConfigError(EXTENSION_KEY, f"importing module {module_name!r} failed: {type(e).__name__}: {e}") from None
    ext = getattr(module, name, None)
    if ext is None:
        raise ConfigError(EXTENSION_KEY, f"module {module_name!r} has no attribute {name!r}")
    if not isinstance(ext, type):
        raise ConfigError(EXTENSION_KEY, f"{path!r} is not a class (type {type(ext).__name__})")
    clash = sorted(public_names(ext) & (public_names(RankWorker) | set(_RESERVED)))
    if clash:
        raise ConfigError(EXTENSION_KEY, f"{ext.__qualname__} defines {', '.join(clash)}, which the worker has "
                                         "already; rename them")
    try:
        return type(f"{ext.__name__}Worker", (RankWorker, ext), {"__module__": __name__})
    except TypeError as e:  # a metaclass or slot layout that cannot be mixed in
        raise ConfigError(EXTENSION_KEY, f"{ext.__qualname__} cannot be mixed into the worker: {e}") from None


def lookup(worker: RankWorker, method: str) -> Callable:
    """The worker's public method ``method``; a RequestError naming it otherwise."""
    if not isinstance(method, str) or not method:
        raise RequestError(f"collective_rpc: method must be a method's name, got {method!r}")
    if method.startswith("_"):
        raise RequestError(f"collective_rpc: {method!r} is private (its name starts with '_'); only public "
                           "methods can be called")
    fn = getattr(worker, method, None)
    if fn is None or not callable(fn) or method in _RESERVED:
        known = sorted(n for n in public_names(type(worker)) if callable(getattr(worker, n)))
        raise RequestError(f"collective_rpc: the worker has no method {method!r}; its methods: {', '.join(known)} "
                           f"(more with {EXTENSION_KEY})")
    return fn


@attrs.frozen
class Outcome:
    """One rank's answer: its method's value, or why it failed; how long it ran."""

    value: object = None
    error: str | None = None
    seconds: float = 0.0


def run_method(worker: RankWorker, method: str, args: tuple, kwargs: dict) -> Outcome:
    """Call ``method`` on this rank's worker. Never raises: every rank must answer rank 0."""
    start = time.monotonic()
    try:
        value = lookup(worker, method)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the method's failure is its answer
        return Outcome(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - start)
    return Outcome(value, None, time.monotonic() - start)


def sendable(outcome: Outcome) -> Outcome:
    """``outcome``, or an error if its value cannot be pickled to rank 0 (a failure there would stop
    this rank in the middle of the gather)."""
    try:
        pickle.dumps(outcome)
    except Exception as e:  # noqa: BLE001 - anything pickling raises
        return Outcome(error=f"its result ({type(outcome.value).__name__}) cannot be sent to rank 0: {e}",
                       seconds=outcome.seconds)
    return outcome


def collective_rpc(engine, method: str, args=(), kwargs: Mapping | None = None,
                   timeout: float | None = None) -> list:
    """Rank 0's side of ``LLMEngine.collective_rpc``: checked here, run on every rank, answered in rank order."""
    if not isinstance(args, (list, tuple)):
        raise RequestError(f"collective_rpc: args must be a list or tuple, got {type(args).__name__}")
    if kwargs is not None and not (isinstance(kwargs, Mapping) and all(isinstance(k, str) for k in kwargs)):
        raise RequestError("collective_rpc: kwargs must be a mapping of names to values")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise RequestError(f"collective_rpc: timeout must be a positive number of seconds or None, got {timeout!r}")
    args, kwargs = tuple(args), dict(kwargs or {})
    lookup(engine.worker, method)  # refused before any rank is asked
    driver, start = engine._driver, time.monotonic()
    if driver is not None:
        message = lockstep.CollectiveRpc(method, args, kwargs)
        try:
            pickle.dumps(message)  # before sending: a failure inside the broadcast would lose the calls pending
        except Exception as e:  # noqa: BLE001 - anything pickling raises
            raise RequestError(f"collective_rpc: the arguments of {method!r} cannot be sent to the other "
                               f"tensor-parallel ranks: {e}") from None
        driver.send_now(message)
    mine = run_method(engine.worker, method, args, kwargs)
    try:
        outcomes = driver.gather(mine) if driver is not None else [mine]
    except Exception as e:  # noqa: BLE001 - e.g. a result rank 0 cannot unpickle (every rank has answered)
        raise CollectiveRpcError(f"collective_rpc: the other ranks' results of {method!r} could not be read on "
                                 f"rank 0: {type(e).__name__}: {e}") from None
    failed = [f"rank {r}: {o.error}" for r, o in enumerate(outcomes) if o.error is not None]
    if failed:
        raise CollectiveRpcError(f"collective_rpc: {method!r} failed on {len(failed)} of {len(outcomes)} "
                                 f"tensor-parallel rank(s): {'; '.join(failed)}")
    elapsed = time.monotonic() - start
    if timeout is not None and elapsed > timeout:
        slow = max(range(len(outcomes)), key=lambda r: outcomes[r].seconds)
        raise CollectiveRpcError(f"collective_rpc: {method!r} timed out: {elapsed:.3g} s, timeout {timeout:g} s "
                                 f"(slowest: rank {slow}, {outcomes[slow].seconds:.3g} s). A running method cannot "
                                 "be interrupted: it ran to its end on every rank; its results were dropped")
    return [o.value for o in outcomes]
