"""A strategy plans and runs one engine step for the scheduled sequences (AR, MTP, ...)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from bi_core.config import EngineConfig
    from bi_core.runtime.engine import LLMEngine
    from bi_core.runtime.scheduler import Scheduled


class Strategy(abc.ABC):
    name: ClassVar[str]
    is_speculative: ClassVar[bool] = False

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    @classmethod
    def lookahead_for(cls, config: EngineConfig) -> int:
        """KV positions past a sequence's known tokens that a step may write (drafts)."""
        return 0

    @classmethod
    def state_ring_for(cls, config: EngineConfig) -> int:
        """GDN state slots per sequence (1 + drafts verified per step)."""
        return 1

    @classmethod
    def decode_tokens_for(cls, config: EngineConfig) -> int:
        """Tokens a decoding sequence's step runs (counted against the step's token budget)."""
        return 1

    @classmethod
    def graph_query_lens(cls, config: EngineConfig) -> tuple[int, ...]:
        """Tokens per sequence of the uniform steps the graph runner captures (1 = decode)."""
        return (1,)

    @classmethod
    def check(cls, engine: LLMEngine) -> None:
        """Raise a clear error if this strategy cannot run with the engine's model/config."""

    def capture_graphs(self) -> int:
        """Capture every CUDA graph this strategy's steps replay (at engine start); returns how many."""
        eng = self.engine
        return eng.runner.capture_all(eng.model_step, eng.cache.block_size, eng.model.prepare_step)

    def forget(self, seq) -> None:
        """The request finished or was aborted: drop anything kept for it."""

    def launched(self) -> list[Scheduled] | None:
        """The live rows of a step the previous ``step`` call launched ahead (the engine's next
        step then books it instead of scheduling one), or None."""
        return None

    @abc.abstractmethod
    def step(self, scheduled: list[Scheduled]) -> None:
        """Run the model on the scheduled tokens and append sampled tokens to the sequences."""
