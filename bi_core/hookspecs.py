"""The whole plugin contract. Hooks only *register* things; the policy decides what is used."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from bi_core.registry import Backend
    from bi_core.strategies.base import Strategy

PROJECT = "bi_engine"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def bi_register_backends(register: Callable[[Backend], None]) -> None:
    """Register backends: call ``register(Backend(name=..., builders=[...]))`` once per backend."""


@hookspec
def bi_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    """Register decoding strategies: call ``register(StrategyClass)``; the class has a ``name``."""
