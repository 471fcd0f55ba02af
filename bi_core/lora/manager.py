"""Adapter slots and versions. A name's adapter lives in one slot; loading the name again
(a trainer's new adapter) writes the new version into a free slot and makes it current, while the
old version's slot keeps serving the requests that pinned it at admission, and is freed once none
is left (a version no request pins gives its slot to the next at once, so one slot serves a
name whose requests all finish between versions). ``max_loras`` slots in all: a load with none
free is refused, naming what holds them."""

from __future__ import annotations

from itertools import count

import attrs

from bi_core.errors import LoraError, RequestError
from bi_core.lora.peft import Adapter
from bi_core.lora.targets import LoraTarget, check_adapter, write_slot


@attrs.frozen
class Loaded:
    """One adapter version in its slot; ``uid`` is unique over the engine's life (prefix-cache key)."""

    name: str
    version: int
    slot: int
    uid: int
    rank: int
    source: str


class LoraManager:
    """Which adapter version each slot holds; the engine's one writer of the adapter stacks."""

    def __init__(self, targets: dict[str, LoraTarget], max_loras: int, max_rank: int) -> None:
        self.targets, self.max_loras, self.max_rank = targets, max_loras, max_rank
        self.free = list(range(max_loras))
        self.current: dict[str, Loaded] = {}
        self.retired: list[Loaded] = []  # replaced or unloaded, still pinned by unfinished requests
        self._uids = count(1)

    def load(self, name: str, adapter: Adapter, in_use: set[int]) -> Loaded:
        """``adapter`` as ``name``'s next version (its first, or the one after the current);
        ``in_use``: the slots unfinished requests pin. Raises LoraError when no slot is free."""
        if not self.max_loras:
            raise LoraError("LoRA is off: start the engine with lora.max_loras > 0 to load adapters")
        placed = check_adapter(adapter, self.targets, self.max_rank)
        self.collect(in_use)
        old = self.current.get(name)
        if not self.free and old is not None and old.slot not in in_use:  # no request pins it: its slot is next
            self.retired.append(self.current.pop(name))
            self.collect(in_use)
        if not self.free:
            held = sorted(f"{x.name} v{x.version}" for x in [*self.current.values(), *self.retired])
            raise LoraError(f"cannot load adapter {name!r}: all lora.max_loras={self.max_loras} slots are taken "
                            f"({', '.join(held)}; old versions free when their requests finish); unload one or "
                            "raise lora.max_loras")
        slot = self.free.pop(0)
        write_slot(self.targets, slot, adapter, placed)
        if name in self.current:
            self.retired.append(self.current[name])
        loaded = Loaded(name, old.version + 1 if old else 1, slot, next(self._uids), adapter.rank, adapter.source)
        self.current[name] = loaded
        self.collect(in_use)
        return loaded

    def unload(self, name: str, in_use: set[int]) -> Loaded:
        """``name`` is no longer served (requests already running on it finish on it)."""
        if name not in self.current:
            raise LoraError(f"no LoRA adapter named {name!r} is loaded (loaded: {', '.join(self.names) or 'none'})",
                            not_found=True)
        gone = self.current.pop(name)
        self.retired.append(gone)
        self.collect(in_use)
        return gone

    def collect(self, in_use: set[int]) -> None:
        """Free the slots of retired versions no unfinished request pins."""
        keep = []
        for x in self.retired:
            (keep.append(x) if x.slot in in_use else self.free.append(x.slot))
        self.retired = keep

    def pin(self, name: str) -> Loaded:
        """The current version of ``name``, for a request being admitted."""
        if not self.max_loras:
            raise RequestError(f"lora_name {name!r}: this engine serves no LoRA adapters (lora.max_loras is 0)")
        if name not in self.current:
            raise RequestError(f"unknown LoRA adapter {name!r}; loaded: {', '.join(self.names) or 'none'}")
        return self.current[name]

    @property
    def names(self) -> list[str]:
        return sorted(self.current)
