"""The engine's LoRA calls: load an adapter (a PEFT directory, or its tensors as a trainer pushes
them) as a name's next version, unload one, list them; requests pin the current version of the
adapter they name when they are admitted (``pin``)."""

from __future__ import annotations

from pathlib import Path

import torch

from bi_core.lora.manager import Loaded, LoraManager
from bi_core.lora.peft import adapter_from_tensors, read_adapter


class LoraAPI:
    """Mixed into LLMEngine (``self.lora``: its LoraManager, ``self.requests``)."""

    lora: LoraManager

    def _start_lora(self) -> None:
        cfg = self.config.lora
        self.lora = LoraManager(self.model.lora_targets, cfg.max_loras, cfg.max_rank)
        for name, path in cfg.adapters.items():
            self.load_lora_adapter(name, path)

    def _lora_in_use(self) -> set[int]:
        return {s.lora_slot for s in self.requests.values() if s.lora_slot >= 0}

    def load_lora_adapter(self, name: str, path: str | Path | None = None, *,
                          tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None) -> Loaded:
        """Load a PEFT adapter from ``path`` (``adapter_config.json`` + ``adapter_model.safetensors``),
        or from ``tensors`` (PEFT's names) and ``config`` (its adapter_config as a dict), as
        ``name``'s next version. Requests admitted from now on get it; those running on an older
        version finish on that one. Call between steps."""
        if (path is None) == (tensors is None):
            raise ValueError("load_lora_adapter: give a path or tensors (with config), not both")
        adapter = read_adapter(path) if path is not None else adapter_from_tensors(
            config or {}, tensors, f"{name!r} (tensors)")
        return self.lora.load(name, adapter, self._lora_in_use())

    def load_lora_adapter_from_tensor(self, name: str, serialized_named_tensors: str | bytes, config: dict) -> Loaded:
        """An adapter a trainer process shares by handle (``bi_core.rl.serialize_named_tensors``:
        shared memory on the CPU, CUDA IPC on this GPU; opened by the same checked unpickler as
        ``update_weights_from_tensor``), as ``name``'s next version; ``config``: its adapter_config."""
        from bi_core.rl.tensors import deserialize_named_tensors

        if not isinstance(config, dict):
            raise ValueError(f"load_lora_adapter_from_tensor: config must be the adapter_config dict, got "
                             f"{type(config).__name__}")
        # the handles are copied into the slot here and closed with this frame (the trainer's memory again)
        return self.load_lora_adapter(name, tensors=dict(deserialize_named_tensors(serialized_named_tensors)),
                                      config=config)

    def unload_lora_adapter(self, name: str) -> Loaded:
        """Stop serving ``name`` (requests already running on it finish on it)."""
        return self.lora.unload(name, self._lora_in_use())

    def lora_adapters(self) -> list[Loaded]:
        """The current version of every loaded adapter, by name."""
        return [self.lora.current[n] for n in self.lora.names]

    def _pin_lora(self, seq) -> None:
        """Give a request being admitted (and its n samples) its adapter's current version."""
        if seq.params.lora_name is None:
            return
        loaded = self.lora.pin(seq.params.lora_name)
        for member in seq.group or [seq]:  # (a scoring request has no group)
            member.lora_slot, member.lora_uid = loaded.slot, loaded.uid
