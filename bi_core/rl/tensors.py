"""Weights shared by handle, not copied through a pipe: SGLang's ``update_weights_from_tensor``.

A trainer on the same GPU (colocated RL) serializes ``(name, tensor)`` pairs with
``serialize_named_tensors``: torch's multiprocessing reducers turn a CUDA tensor into a CUDA IPC
handle and a CPU tensor into a shared-memory file name, pickled (``ForkingPickler``) and base64
encoded, so the payload is a few hundred bytes per tensor whatever its size. The engine opens the
handles (``deserialize_named_tensors``; never with a general unpickler: ``handles.py`` reads tensor
handles and nothing else), copies into its parameters (``LLMEngine.update_weights``, which checks
every name, shape and dtype first) and lets go of them. The trainer keeps its tensors
(and its process) alive until the call has returned.

The format is SGLang's ``MultiprocessingSerializer.serialize(named_tensors, output_str=True)``, so a
trainer written for SGLang's route sends the same payload here."""

from __future__ import annotations

import base64
import contextlib
import io
from collections.abc import Iterable, Iterator, Mapping
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as tmp  # registers torch's reducers with ForkingPickler

from bi_core.errors import RequestError
from bi_core.rl.handles import open_pairs

LOAD_FORMATS = (None, "direct")  # SGLang's default: a list of (name, tensor) pairs


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    """CPU storages by shared-memory file name: the default (file descriptors) hands them over a
    socket only to processes of the same multiprocessing family, which an engine is not."""
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)


def serialize_named_tensors(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """The payload of one ``update_weights_from_tensor`` call (a base64 string): handles to the
    tensors, not their bytes. CUDA tensors must be on the engine's GPU (CUDA IPC)."""
    pairs = [(str(n), t.detach()) for n, t in (named.items() if isinstance(named, Mapping) else named)]
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"serialize_named_tensors: {name!r} is a {type(t).__name__}, not a tensor")
    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf).dump(pairs)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """Open a ``serialize_named_tensors`` payload (base64 text, or its raw pickle bytes): the
    trainer's tensors, shared. A payload that does not open, or that holds anything but tensor
    handles (``handles.HandleUnpickler``), is a RequestError saying why."""
    try:
        raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    except ValueError as e:
        raise RequestError(f"update_weights_from_tensor: the payload is not base64 ({e})") from None
    return open_pairs(raw)  # never a general unpickler: only tensor handles (handles.py)
