"""bi-engine: a batch-invariant inference engine for the Qwen3.5 model family."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bi_core.config import EngineConfig
from bi_core.errors import (
    BackendSelectionError,
    BatchInvarianceUnsupported,
    BiEngineError,
    CheckpointError,
    ConfigError,
    PluginError,
    PolicyError,
    PromptTooLongError,
    RequestError,
)
from bi_core.hookspecs import hookimpl
from bi_core.runtime.sequence import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from bi_core.registry import Registry
    from bi_core.runtime.engine import LLMEngine

__version__ = "0.1.0"


def build_engine(config: EngineConfig, registry: Registry | None = None) -> LLMEngine:
    """Build an engine from a config (``EngineConfig.from_yaml(path)`` or ``.from_dict({...})``)."""
    from bi_core.runtime.launch import build_engine as build

    return build(config, registry)


__all__ = [
    "BackendSelectionError", "BatchInvarianceUnsupported", "BiEngineError", "CheckpointError", "ConfigError",
    "EngineConfig", "PluginError", "PolicyError", "PromptTooLongError", "RequestError", "RequestOutput",
    "SamplingParams", "build_engine", "hookimpl",
]
