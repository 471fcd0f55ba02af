"""Random weights for preset models, drawn on the target device from a seed.

Scaled so activations stay O(1) through the depth (weights ~ N(0, 1/fan_in)), norms near their
identity, GDN decays in a realistic range; outputs are then far from uniform and ties are rare.
"""

from __future__ import annotations

import math

import torch

from bi_core.quant.params import draw_shape, drawn_elsewhere, write_drawn


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device=model.device)
    gen.manual_seed(seed)
    for name, p in model.named_parameters():
        if drawn_elsewhere(p):  # FP8 block scales, rows drawn with another parameter (bi_core/quant/params.py)
            continue
        # tensor parallelism: draw the full tensor (the same numbers as one GPU), keep this rank's part;
        # FP8: the unquantized model's numbers, quantized block-wise
        shape = draw_shape(p)
        if name.endswith("A_log"):
            vals = torch.empty(shape, device=p.device).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            vals = torch.empty(shape, device=p.device).uniform_(-1.0, 1.0, generator=gen)
        elif name.endswith("norm_weight"):  # gated norm: plain weight around 1
            vals = 1.0 + 0.1 * torch.randn(shape, device=p.device, generator=gen)
        elif p.dim() == 1:  # zero-centred norms store scale - 1
            vals = 0.1 * torch.randn(shape, device=p.device, generator=gen)
        elif name == "embed_tokens":
            vals = torch.randn(shape, device=p.device, generator=gen)
        else:  # conv1d, linear [out, in] or experts [E, out, in]; in place: one float32 temporary (an
            # expert stack's is 6 GiB on the 122B shape, drawn beside the FP8 weights already allocated)
            vals = torch.randn(shape, device=p.device, generator=gen).div_(math.sqrt(shape[-1]))
        write_drawn(p, vals)
    for module in model.modules():
        if hasattr(module, "zero_padding"):
            module.zero_padding()
