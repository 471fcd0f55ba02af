"""Whether the engine's weights are whole, and what is missing when they are not.

Two things leave the model unfit to serve: a level-2 sleep (the weights are dropped: after
``wake_up`` their memory holds whatever was there, until a weight update fills them) and a weight
update that failed after some buckets were copied (part old, part new). Meanwhile every request is
refused with ``WeightsMissing`` (HTTP: 409) instead of generating from garbage, and ``/health``
says why. The parts still missing are tracked as the weight map's regions (``models/weight_map``:
a Hugging Face tensor fills its regions of a parameter; an engine name fills the whole parameter),
so a sync that sends the weights in several calls serves once the last region has landed."""

from __future__ import annotations

from collections.abc import Iterable

from bi_core.errors import RequestError
from bi_core.models.weight_map import weight_map

SYNC_HINT = "update_weights_from_tensor, update_weights_from_distributed or update_weights_from_disk"


class WeightsMissing(RequestError):
    """The engine has no whole weights to serve with (a level-2 sleep, or a broken update)."""


class Coverage:
    """The regions of each parameter that no update has written since they were lost."""

    def __init__(self, model) -> None:
        self.model = model
        self.missing: dict[str, set] = {}
        self.reason = ""

    @property
    def whole(self) -> bool:
        return not self.missing

    def lose_all(self, reason: str) -> None:
        """Every weight is gone (a level-2 sleep)."""
        required = weight_map(self.model.args, with_mtp=self.model.mtp is not None).required
        self.missing = {param: set(regions) for param, regions in required.items()}
        self.reason = reason

    def lose(self, steps: Iterable, reason: str) -> None:
        """These copy steps were written by an update that did not complete."""
        for st in steps:
            self.missing.setdefault(st.placement.param, set()).update(st.placement.regions)
        if self.missing:
            self.reason = reason

    def landed(self, steps: Iterable) -> None:
        """A complete update wrote these copy steps (``loader.check_update``'s)."""
        for st in steps:
            pl = st.placement
            regions = self.missing.get(pl.param)
            if regions is None:
                continue
            if (pl.param,) in pl.regions:  # the engine's own name, or a whole-parameter tensor
                regions.clear()
            else:
                regions.difference_update(pl.regions)
            if not regions:
                del self.missing[pl.param]

    def check(self) -> None:
        """WeightsMissing while a region is missing."""
        if self.missing:
            raise WeightsMissing(f"the engine's weights are missing: {self.reason}; sync weights first (requests are "
                                 f"refused until a weight update fills the {len(self.missing)} parameter(s) left: "
                                 f"{SYNC_HINT})")
