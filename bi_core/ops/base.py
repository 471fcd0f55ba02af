"""The op-builder contract: a frozen Spec describes one use of an op, a Builder says whether it
can serve that spec under a policy (with reasons when it cannot) and builds a stateless Impl."""

from __future__ import annotations

import abc
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

    def check(self, spec: SpecT, policy: Policy) -> list[str]:
        """Reasons this builder cannot serve ``spec`` under ``policy``; empty means it can."""
        return []

    @abc.abstractmethod
    def build(self, spec: SpecT) -> object:
        """Return the impl: a stateless object whose methods do the compute."""


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
