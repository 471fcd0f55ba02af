"""Every error bi-engine raises on purpose. The CLI prints these as one line, no traceback."""

from __future__ import annotations


class BiEngineError(Exception):
    """Base class: a problem the user can act on (bad config, refused backend, bad prompt)."""


class ConfigError(BiEngineError):
    """A config value is wrong; the message starts with the key path (``scheduler.max_num_seqs``)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.reason = message
        super().__init__(f"{path}: {message}" if path else message)


class CheckpointError(BiEngineError):
    """A checkpoint is missing a file or a tensor, or a tensor has the wrong shape."""


class PolicyError(BiEngineError):
    """The configuration asks for something the selected mode cannot guarantee."""


class BatchInvarianceUnsupported(PolicyError):
    """A backend was asked for batch invariance and cannot give it."""

    def __init__(self, backend: str, reason: str) -> None:
        self.backend = backend
        super().__init__(f"backend '{backend}' does not support batch-invariant mode: {reason}")


class BackendSelectionError(BiEngineError):
    """No registered builder could serve an op; carries the whole table of refusals."""

    def __init__(self, op: str, table: list[tuple[str, list[str]]]) -> None:
        self.op = op
        self.table = table
        lines = [f"no backend can serve op '{op}':"]
        lines += [f"  - {backend}: {'; '.join(reasons)}" for backend, reasons in table]
        if not table:
            lines.append("  (no backend is in the preference order for this op)")
        super().__init__("\n".join(lines))


class PluginError(BiEngineError):
    """A plugin failed to load or implements a hook that does not exist."""


class RequestError(BiEngineError):
    """A single request cannot be served (prompt too long, bad sampling parameters)."""


class PromptTooLongError(RequestError):
    """The prompt does not fit the model's context length or the KV cache."""


class CollectiveRpcError(BiEngineError):
    """A ``collective_rpc`` method raised on a tensor-parallel rank, or the call outlasted its timeout."""


class LoraError(BiEngineError):
    """A LoRA adapter cannot be loaded or unloaded (unknown name, every slot taken, a bad adapter)."""

    def __init__(self, message: str, *, not_found: bool = False) -> None:
        super().__init__(message)
        self.not_found = not_found
