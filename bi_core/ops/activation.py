"""An activation with its block-FP8 copy: what a norm that feeds FP8 projections hands them
(``NormSpec.fp8_group``), so the projections skip their own quantization launch."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class Fp8Activation:
    """``x [T, K]`` in the activation dtype and its per-token-group quantization: ``q`` float8_e4m3fn
    ``[T, K]`` and ``scale`` float32 ``[T, ceil(K / group)]``, bitwise what the linear op's own
    quantization of ``x`` gives (a row's copy depends on that row alone). Consumers that quantize
    ``x`` (block-FP8 linears and experts) take ``fp8`` in its place; the others read ``x``."""

    x: torch.Tensor
    q: torch.Tensor
    scale: torch.Tensor

    @property
    def fp8(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, self.scale


def dense(x: torch.Tensor | Fp8Activation) -> torch.Tensor:
    """The activation itself, with or without its FP8 copy."""
    return x.x if isinstance(x, Fp8Activation) else x
