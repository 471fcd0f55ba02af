"""How a weight is split over tensor-parallel ranks, declared once per parameter by the model
(``Qwen35Model``) and applied by the loader and the random initialiser.

A :class:`Shard` splits one dim of the full tensor. The dim is a concatenation of parts (fused
projections: ``q|k|v``, ``qkv|z|b|a``, ``gate|up``); each part is split on its own, at unit
boundaries (heads), so rank r holds units ``[r*u/N, (r+1)*u/N)`` of every part, in part order.
A part with fewer units than ranks (KV heads when N > Hkv) is replicated: rank r holds unit
``r*u // N``."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class Shard:
    dim: int
    parts: tuple[tuple[int, int], ...]  # (size along dim, units) per contiguous part

    def ranges(self, rank: int, world: int) -> list[tuple[int, int]]:
        """(start, stop) along ``dim`` of the full tensor, per part, that ``rank`` holds."""
        out, offset = [], 0
        for size, units in self.parts:
            per = size // units
            if units >= world:
                lo, hi = rank * units // world, (rank + 1) * units // world
            else:
                lo = rank * units // world
                hi = lo + 1
            out.append((offset + lo * per, offset + hi * per))
            offset += size
        return out

    def local_size(self, world: int) -> int:
        return sum(hi - lo for lo, hi in self.ranges(0, world))

    def take(self, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """This rank's slice of the full tensor."""
        pieces = [full.narrow(self.dim, lo, hi - lo) for lo, hi in self.ranges(rank, world)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)


def split(dim: int, *parts: int | tuple[int, int]) -> Shard:
    """``split(0, (2*hq*d, hq), (hkv*d, hkv))``; a bare size splits row by row (units = size)."""
    return Shard(dim, tuple(p if isinstance(p, tuple) else (p, p) for p in parts))


@attrs.frozen
class TPInfo:
    """This process's place among the tensor-parallel ranks."""

    rank: int = 0
    world: int = 1

    def local_shape(self, shape: tuple[int, ...], shard: Shard | None) -> tuple[int, ...]:
        if shard is None or self.world == 1:
            return tuple(shape)
        out = list(shape)
        out[shard.dim] = shard.local_size(self.world)
        return tuple(out)
