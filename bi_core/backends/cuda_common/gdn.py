"""Gated DeltaNet on CUDA: decode/verify sequences through the fused recurrent kernel
(``kernels/gdn_decode.py``: conv, gates, delta rule, gated norm in one launch, state slots in
place); prefill sequences through our conv kernel, fla's ``chunk_gated_delta_rule`` (varlen,
states gathered/scattered by slot) and the gated-norm kernel."""

from __future__ import annotations

import sys

import torch

from bi_core.ops.context import ForwardContext
from bi_core.ops.gdn import GdnSpec, GdnWeights


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
        self.spec = spec
        self.scale = spec.head_k_dim**-0.5
        if pin_autotune:
            import fla.ops.gated_delta_rule  # noqa: F401 - imported first, so pinning sees every module

            pin_fla_autotune()

    def forward(self, proj, weights: GdnWeights, conv_state, state, ctx: ForwardContext) -> torch.Tensor:
        from bi_core.kernels.gdn_decode import gdn_decode

        s = self.spec
        out = torch.empty((proj.shape[0], s.value_dim), dtype=proj.dtype, device=proj.device)
        if ctx.recurrent_ids.shape[0]:
            gdn_decode(proj, weights.conv1d, weights.A_log, weights.dt_bias, weights.norm, conv_state, state,
                       ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots, ctx.token_state_slots, ctx.recurrent_ids,
                       out, num_k_heads=s.num_k_heads, head_k_dim=s.head_k_dim, eps=s.norm_eps,
                       per_token=ctx.state_ring > 1)
        meta = self._chunk_meta(ctx)
        if meta is not None:
            self._prefill(proj, weights, conv_state, state, ctx, meta, out)
        return out

    def _chunk_meta(self, ctx: ForwardContext):
        """Token rows, cu_seqlens, read slots, has-past flags, last-token slots and ids of the
        chunked-form sequences (None in decode-only steps, e.g. every captured graph)."""
        key = "gdn_chunk"
        if key not in ctx.op_plans:
            seqs = [i for i, r in enumerate(ctx.is_recurrent_host) if not r]
            if not seqs:
                ctx.op_plans[key] = None
                return None
            dev = ctx.positions.device
            tokens, cu, longest = [], [0], 0
            for i in seqs:
                a, b = ctx.token_range(i)
                tokens += range(a, b)
                cu.append(cu[-1] + b - a)
                longest = max(longest, b - a)
            last = [ctx.token_state_slots_host[ctx.token_range(i)[1] - 1] for i in seqs]
            contiguous = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
            ctx.op_plans[key] = dict(
                rows=slice(tokens[0], tokens[0] + len(tokens)) if contiguous
                else torch.tensor(tokens, dtype=torch.int64, device=dev),
                cu=torch.tensor(cu, dtype=torch.int64, device=dev),
                slots=torch.tensor([ctx.state_slots_host[i] for i in seqs], dtype=torch.int64, device=dev),
                has_past=torch.tensor([ctx.past_len(i) > 0 for i in seqs], dtype=torch.bool, device=dev),
                final_slots=torch.tensor(last, dtype=torch.int64, device=dev),
                seq_ids=torch.tensor(seqs, dtype=torch.int64, device=dev), longest=longest)
        return ctx.op_plans[key]

    def _prefill(self, proj, weights: GdnWeights, conv_state, state, ctx: ForwardContext, meta: dict, out) -> None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        from bi_core.backends.reference.gdn import gates, split_proj
        from bi_core.kernels.conv1d import causal_conv1d
        from bi_core.kernels.norm import gated_rms_norm

        s = self.spec
        mixed, z, b, a = split_proj(proj, s)
        # the conv straight into contiguous q / k / v buffers (fla reads those without a copy)
        qkv = []
        for lo, width in ((0, s.key_dim), (s.key_dim, s.key_dim), (2 * s.key_dim, s.value_dim)):
            qkv.append(causal_conv1d(
                mixed[:, lo:lo + width], weights.conv1d[lo:lo + width], conv_state[:, lo:lo + width],
                ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots, ctx.token_state_slots,
                per_token=ctx.state_ring > 1, seq_ids=meta["seq_ids"], max_tokens=meta["longest"],
                out=torch.empty((proj.shape[0], width), dtype=proj.dtype, device=proj.device)))
        rows = meta["rows"]  # the chunked-form rows: a slice when they are contiguous (views), else an index
        q, k, v = (t[rows] for t in qkv)
        n = q.shape[0]
        g, beta = gates(a[rows], b[rows], weights)
        # fla's states are [N, Hv, Dk, Dv]; the cache holds them transposed ([Hv, Dv, Dk])
        init = torch.where(meta["has_past"][:, None, None, None], state[meta["slots"]].float().transpose(-1, -2), 0.0)
        o, final = chunk_gated_delta_rule(
            q.view(1, n, s.num_k_heads, s.head_k_dim), k.view(1, n, s.num_k_heads, s.head_k_dim),
            v.view(1, n, s.num_v_heads, s.head_v_dim), g=g[None], beta=beta[None], scale=self.scale,
            initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=meta["cu"])
        state.index_copy_(0, meta["final_slots"], final.transpose(-1, -2).to(state.dtype))
        o = o[0].to(proj.dtype).reshape(n, s.value_dim)
        if isinstance(rows, slice):  # normalised straight into the layer output's rows
            gated_rms_norm(o, z[rows], weights.norm, s.norm_eps, head_dim=s.head_v_dim, out=out[rows])
        else:
            out.index_copy_(0, rows, gated_rms_norm(o, z[rows], weights.norm, s.norm_eps, head_dim=s.head_v_dim))
