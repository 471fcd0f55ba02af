"""A strategy plans and runs one engine step for the scheduled sequences (AR, MTP, ...)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from bi_core.runtime.engine import LLMEngine
    from bi_core.runtime.scheduler import Scheduled


class Strategy(abc.ABC):
    name: ClassVar[str]
    is_speculative: ClassVar[bool] = False
    lookahead: ClassVar[int] = 0  # KV slots past the known tokens a step may write

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @classmethod
    def check(cls, engine: LLMEngine) -> None:
        """Raise a clear error if this strategy cannot run with the engine's model/config."""

    @abc.abstractmethod
    def step(self, scheduled: list[Scheduled]) -> None:
        """Run the model on the scheduled tokens and append sampled tokens to the sequences."""
