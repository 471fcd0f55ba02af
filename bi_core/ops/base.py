"""The op-builder contract: a frozen Spec describes one use of an op, a Builder says whether it
can serve that spec under a policy (with reasons when it cannot) and builds a stateless Impl."""

from __future__ import annotations

import abc
import functools
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import attrs
import torch

if TYPE_CHECKING:
    from bi_core.policies.base import Policy

SpecT = TypeVar("SpecT", bound="OpSpec")


@attrs.frozen(kw_only=True)
class OpSpec:
    """What every op spec has: the dtype of its activations and the device it runs on."""

    dtype: torch.dtype
    device: torch.device


class OpBuilder(abc.ABC, Generic[SpecT]):
    """Builds one op's implementation for one backend.

    ``op`` names the op family (one of ``bi_core.config.OP_NAMES``); ``is_batch_invariant``
    declares that every row's result depends only on that row's data, whatever the batch.
    """

    op: ClassVar[str]
    is_batch_invariant: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        check = cls.check
        if getattr(check, "contract_first", False):
            return

        @functools.wraps(check)
        def guarded(self, spec, policy):
            return self.contract_refusals(spec) or check(self, spec, policy)

        guarded.contract_first = True
        cls.check = guarded

    def contract_refusals(self, spec: SpecT) -> list[str]:
        """Reasons from the op family's contract, checked before every builder's own ``check``:
        a spec asking for something a builder does not declare it serves (a weight format, an
        output form added after the builder was written) is refused, so a builder never receives
        a spec it would misread. Op families override it; builders declare, they do not override."""
        return []

    def check(self, spec: SpecT, policy: Policy) -> list[str]:
        """Reasons this builder cannot serve ``spec`` under ``policy``; empty means it can."""
        return []

    @abc.abstractmethod
    def build(self, spec: SpecT) -> object:
        """Return the impl: a stateless object whose methods do the compute."""


def backend_of(cls: type) -> str:
    """The backend package a builder class lives in (``bi_core.backends.<name>...``), or its
    top-level package (a third-party backend)."""
    parts = cls.__module__.split(".")
    return parts[parts.index("backends") + 1] if "backends" in parts[:-1] else parts[0]


def require_hopper(spec: OpSpec) -> list[str]:
    """A reason unless the spec's device is an SM90 (Hopper) GPU."""
    if spec.device.type != "cuda":
        return [f"needs an SM90 GPU, spec is on {spec.device}"]
    if not torch.cuda.is_available():  # explain on a machine without the GPU: not checkable here
        return []
    major, minor = torch.cuda.get_device_capability(spec.device)
    return [] if major == 9 else [f"needs SM90 (Hopper), device is SM{major}{minor}"]


def require_module(name: str) -> list[str]:
    """A reason unless the Python package ``name`` can be imported."""
    import importlib.util

    return [] if importlib.util.find_spec(name) is not None else [f"package '{name}' is not installed"]
