"""The trainer's side of weight sync (the protocol: ``bi_core.rl.sync_protocol``).

    sender = WeightSender("127.0.0.1", 29600, world_size=1 + tp)   # blocks until the engine joins
    # meanwhile, in the engine's process: engine.init_weights_update_group("127.0.0.1", 29600, 1, 1 + tp)
    sender.send(model.named_parameters(),
                lambda names, dtypes, shapes: engine_client.update_weights_from_distributed(names, dtypes, shapes))
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

from bi_core.errors import BiEngineError
from bi_core.rl.sync_protocol import (
    GO,
    WeightGroup,
    bucket_layout,
    dtype_name,
    fingerprint,
    no_go,
    resolve_backend,
    view,
)

DEFAULT_BUCKET_MB = 512


class _Call(threading.Thread):
    """``request_update`` running beside the broadcasts; its result or error kept."""

    def __init__(self, fn: Callable, *args) -> None:
        super().__init__(daemon=True, name="bi-engine-request-update")
        self.fn, self.args = fn, args
        self.result, self.error = None, None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 - handed to the trainer's thread
            self.error = e

    def finished_early(self) -> str | None:
        """Why the handshake will not come: ``request_update`` ended before it."""
        if self.is_alive():
            return None
        if self.error is not None:
            return f"the engine refused the update before the handshake: {self.error}"
        return "request_update returned before the engine took part in the handshake"


class WeightSender:
    """Rank 0 of a weight-update group: sends tensors to the engine ranks that joined it
    (``engine.init_weights_update_group``). ``backend`` None: nccl when CUDA is available, else gloo."""

    def __init__(self, master_address: str, master_port: int, world_size: int, *,
                 group_name: str = "weight_update_group", backend: str | None = None, timeout_s: float = 300.0,
                 device: torch.device | str | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        backend = resolve_backend(backend, device)
        self.group = WeightGroup(group_name, master_address, master_port, 0, world_size, backend, device, timeout_s)
        self.broken: str | None = None  # set once the group's collectives are out of step

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], request_update: Callable,
             *, bucket_mb: float = DEFAULT_BUCKET_MB):
        """Send ``(name, tensor)`` pairs (Hugging Face names or the engine's own): ``request_update
        (names, dtypes, shapes)`` runs in a thread while this takes part in the handshake and
        broadcasts the buckets. Returns what ``request_update`` returned; raises BiEngineError when
        the engine refused (its reason), or a stage failed or timed out."""
        if self.broken is not None:
            raise BiEngineError(f"weight-update group '{self.group.name}' is out of step ({self.broken}); close this "
                                "sender and join a new group")
        pairs = list(named_tensors)
        if not pairs or not all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in pairs):
            raise BiEngineError("send: named_tensors must be a non-empty iterable of (str, torch.Tensor) pairs")
        pairs = [(n, t.detach()) for n, t in pairs]
        names = [n for n, _ in pairs]
        dtypes = [dtype_name(t.dtype) for _, t in pairs]
        shapes = [list(t.shape) for _, t in pairs]
        bucket_bytes = max(1, int(bucket_mb * 2**20))
        call = _Call(request_update, names, dtypes, shapes)
        call.start()
        try:
            rows = self.group.handshake([GO, bucket_bytes, fingerprint(names, [t.dtype for _, t in pairs], shapes)],
                                        abandon=call.finished_early)
        except BiEngineError as e:
            self.broken = str(e)  # the engine may still answer this handshake later: the group is unusable
            raise
        why = no_go(rows)
        if why is not None:
            self._join(call)
            raise self._failed(call, f"the handshake said no: {why}")
        try:
            self._broadcast(pairs, bucket_layout([t.numel() * t.element_size() for _, t in pairs], bucket_bytes))
            worst = self.group.confirm(GO)
        except BiEngineError as e:
            self.broken = str(e)
            raise
        self._join(call)
        if worst != GO or call.error is not None:
            raise self._failed(call, "an engine rank could not copy the update into its model")
        return call.result

    def _broadcast(self, pairs, layout) -> None:
        for i, bucket in enumerate(layout):
            buf = torch.empty(bucket.size, dtype=torch.uint8, device=self.group.device)
            for j, offset, n in bucket.entries:
                t = pairs[j][1]
                view(buf, offset, n, t.shape, t.dtype).copy_(t)
            self.group.broadcast(buf, f"sending bucket {i + 1} of {len(layout)} to the engine")

    def _join(self, call: _Call) -> None:
        call.join(self.group.timeout_s)
        if call.is_alive():
            self.broken = "request_update did not return"
            raise BiEngineError(f"request_update did not return within {self.group.timeout_s:g} s of the update")

    @staticmethod
    def _failed(call: _Call, why: str) -> BiEngineError:
        """The engine's own error (what ``request_update`` raised), else ``why``."""
        err = BiEngineError(f"the update did not land: {call.error if call.error is not None else why}")
        err.__cause__ = call.error
        return err

    def close(self) -> None:
        """Leave the group (the engine side: ``destroy_weights_update_group``)."""
        self.group.close()

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
