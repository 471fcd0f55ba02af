"""Gated DeltaNet on CUDA: our Triton conv1d and recurrent kernels (state slots, in place) and
fla's ``chunk_gated_delta_rule`` for prefill sequences (varlen, states gathered/scattered)."""

from __future__ import annotations

import sys

import torch

from bi_core.ops.context import ForwardContext
from bi_core.ops.gdn import GdnSpec


def pin_fla_autotune() -> int:
    """Replace every fla autotuner's candidate list by its first config, so no kernel config is
    chosen by timing (which could differ between processes). Returns how many were pinned."""
    from triton.runtime.autotuner import Autotuner

    pinned = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in vars(module).values():
            target = obj
            while target is not None and not isinstance(target, Autotuner):
                target = getattr(target, "fn", None) if not isinstance(target, type) else None
            if isinstance(target, Autotuner) and len(target.configs) > 1:
                target.configs = target.configs[:1]
                pinned += 1
    return pinned


class CudaGdnImpl:
    def __init__(self, spec: GdnSpec, *, pin_autotune: bool) -> None:
        import fla.ops.gated_delta_rule  # noqa: F401 - imported here so pinning sees every module

        self.spec = spec
        self.scale = spec.head_k_dim**-0.5
        if pin_autotune:
            pin_fla_autotune()

    def conv(self, x, weight, conv_state, ctx: ForwardContext) -> torch.Tensor:
        from bi_core.kernels.conv1d import causal_conv1d

        return causal_conv1d(x, weight, conv_state, ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots,
                             ctx.token_state_slots, per_token=ctx.state_ring > 1)

    def _chunk_meta(self, ctx: ForwardContext):
        key = "gdn_chunk"
        if key not in ctx.extras:
            dev = ctx.positions.device
            seqs = [i for i, r in enumerate(ctx.is_recurrent_host) if not r]
            if not seqs:  # decode-only step (also every captured graph): nothing to build
                ctx.extras[key] = (None, None, None, None, 0, None)
                return ctx.extras[key]
            tokens, cu = [], [0]
            for i in seqs:
                a, b = ctx.token_range(i)
                tokens += range(a, b)
                cu.append(cu[-1] + b - a)
            has_past = [ctx.past_len(i) > 0 for i in seqs]
            last_token_slots = [ctx.token_state_slots_host[ctx.token_range(i)[1] - 1] for i in seqs]
            ctx.extras[key] = (
                torch.tensor(tokens, dtype=torch.int64, device=dev),
                torch.tensor(cu, dtype=torch.int64, device=dev),
                torch.tensor([ctx.state_slots_host[i] for i in seqs], dtype=torch.int64, device=dev),
                torch.tensor(has_past, dtype=torch.bool, device=dev),
                len(seqs),
                torch.tensor(last_token_slots, dtype=torch.int64, device=dev),
            )
        return ctx.extras[key]

    def delta_rule(self, q, k, v, g, beta, state, ctx: ForwardContext) -> torch.Tensor:
        from bi_core.kernels.gdn_recurrent import gdn_recurrent

        out = torch.empty_like(v)
        if ctx.recurrent_ids.shape[0]:
            gdn_recurrent(q, k, v, g, beta, state, ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots,
                          ctx.token_state_slots, per_token=ctx.state_ring > 1, seq_ids=ctx.recurrent_ids, out=out)
        tokens, cu, slots, has_past, num, final_slots = self._chunk_meta(ctx)
        if num:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            init = torch.where(has_past[:, None, None, None], state[slots].float(), 0.0)
            o, final = chunk_gated_delta_rule(
                q[tokens][None], k[tokens][None], v[tokens][None], g=g[tokens][None], beta=beta[tokens][None],
                scale=self.scale, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu)
            state.index_copy_(0, final_slots, final.to(state.dtype))
            out.index_copy_(0, tokens, o[0].to(out.dtype))
        return out
