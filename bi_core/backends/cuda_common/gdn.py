"""Gated DeltaNet on CUDA: decode/verify sequences through the recurrent kernels
(``kernels/gdn_decode.py``: conv, gates, delta rule, gated norm, state slots in place); prefill sequences through our conv kernel, fla's ``chunk_gated_delta_rule`` (varlen,
states gathered/scattered by slot) and the gated-norm kernel."""

from __future__ import annotations

import importlib.util

import torch

from bi_core.backends.cuda_common import fla_tuning
from bi_core.ops.context import ForwardContext
from bi_core.ops.gdn import GdnSpec, GdnWeights
from bi_core.runtime.batch import to_device


class CudaGdnImpl:
    def __init__(self, spec: GdnSpec, *, pin_autotune: bool) -> None:
        self.spec = spec
        self.scale = spec.head_k_dim**-0.5
        if pin_autotune:  # invariant: no timing picks a config
            fla_tuning.pin_first()
        elif importlib.util.find_spec("fla") is not None:  # default: the configs recorded for this GPU
            # family; anything else timed once per machine (and Triton cache directory), then read
            # back. Without fla (the CPU interpreter's test engines, whose prompts never reach the
            # chunked form) there is nothing to tune
            fla_tuning.cache_on_disk()
            if torch.cuda.is_available():
                fla_tuning.pin_for_device(torch.cuda.get_device_capability())

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

    def _chunk_meta(self, ctx: ForwardContext) -> dict | None:
        """The chunked-form sequences' plan, from the step's shape alone (None in decode-only
        steps): their token rows, cu_seqlens, fla's chunk indices and offsets, their indices in
        the batch, query lengths and last rows; one upload. A graph's static context keeps it
        for every replay, so nothing in it may depend on positions, slots or pages: those are
        ``_step_tensors``, derived on the device."""
        key = "gdn_chunk"
        if key not in ctx.op_plans:
            seqs = [i for i, r in enumerate(ctx.is_recurrent_host) if not r]
            if not seqs:
                ctx.op_plans[key] = None
                return None
            spans = [ctx.token_range(i) for i in seqs]
            lens = [b - a for a, b in spans]
            tokens = [t for a, b in spans for t in range(a, b)]
            contiguous = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
            cu, offsets, indices = [0], [0], []
            for j, n in enumerate(lens):
                cu.append(cu[-1] + n)
                chunks = -(-n // FLA_CHUNK)
                offsets.append(offsets[-1] + chunks)
                indices += [x for t in range(chunks) for x in (j, t)]
            fields = dict(cu=cu, chunk_indices=indices, chunk_offsets=offsets, seq_ids=seqs, query_lens=lens,
                          last_rows=[b - 1 for _, b in spans], rows=[] if contiguous else tokens,
                          # each row's sequence (among these) and offset in it: padding masks (graphs)
                          row_seq=[j for j, n in enumerate(lens) for _ in range(n)] if ctx.graph else [],
                          row_offset=[t for n in lens for t in range(n)] if ctx.graph else [],
                          row_start=[c for c, n in zip(cu, lens) for _ in range(n)] if ctx.graph else [])
            flat = [x for f in fields.values() for x in f + [0] * (len(f) % 2)]  # 16-byte aligned views
            parts = torch.split(to_device(flat, ctx.positions.device), [len(f) + len(f) % 2 for f in fields.values()])
            plan = {name: t[: len(f)] for (name, f), t in zip(fields.items(), parts)}
            plan["chunk_indices"] = plan["chunk_indices"].view(-1, 2)
            plan["rows"] = slice(tokens[0], tokens[0] + len(tokens)) if contiguous else plan["rows"]
            plan["longest"] = max(lens)
            ctx.op_plans[key] = plan
        return ctx.op_plans[key]

    @staticmethod
    def _step_tensors(ctx: ForwardContext, meta: dict) -> dict:
        """Per forward, on the device: the state slot each chunked sequence reads, whether it has
        a past (else its state starts at zero), and the slot its final state goes to."""
        key = "gdn_chunk"
        if key not in ctx.step_tensors:
            ids = meta["seq_ids"]
            ctx.step_tensors[key] = dict(
                slots=ctx.state_slots.index_select(0, ids),
                has_past=ctx.context_lens.index_select(0, ids) > meta["query_lens"],
                final_slots=ctx.token_state_slots.index_select(0, meta["last_rows"]))
            if ctx.valid_tokens is not None:  # a graph may pad a sequence at its end: its real rows
                n = ctx.valid_tokens.index_select(0, ids).index_select(0, meta["row_seq"])  # per row: its sequence's
                off = meta["row_offset"]
                ctx.step_tensors[key]["pad"] = dict(
                    real=off < n,
                    # a padding row's decay: its fla chunk's last real row's (what fla reads at a
                    # chunk's end), or none (0) in a chunk of padding only
                    last=meta["row_start"] + (n - 1).clamp(min=0), same=off // FLA_CHUNK == (n - 1) // FLA_CHUNK)
        return ctx.step_tensors[key]

    def _prefill(self, proj, weights: GdnWeights, conv_state, state, ctx: ForwardContext, meta: dict, out) -> None:
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
                seq_ids=meta["seq_ids"], max_tokens=meta["longest"],
                out=torch.empty((proj.shape[0], width), dtype=proj.dtype, device=proj.device), valid=ctx.valid_tokens))
        rows = meta["rows"]  # the chunked-form rows: a slice when they are contiguous (views), else an index
        q, k, v = (t[rows] for t in qkv)
        n = q.shape[0]
        g, beta = gates(a[rows], b[rows], weights)
        step = self._step_tensors(ctx, meta)
        pad = step.get("pad")
        if pad is not None:
            # Padding rows at a sequence's end enter fla as zeros: what its masked loads give past a
            # sequence, so the real rows get the bits they would get unpadded, and a chunk of zeros
            # (decay exp2(0) = 1, no update) leaves the final state as it is (chunk_rule also gives
            # them the decay fla reads at a chunk's end)
            real = pad["real"][:, None]
            q, k, v, g, beta = (torch.where(real, x, 0) for x in (q, k, v, g, beta))
        # fla's states are [N, Hv, Dk, Dv]; the cache holds them transposed ([Hv, Dv, Dk])
        init = torch.where(step["has_past"][:, None, None, None], state[step["slots"]].float().transpose(-1, -2), 0.0)
        o, final = chunk_rule(
            q.view(1, n, s.num_k_heads, s.head_k_dim), k.view(1, n, s.num_k_heads, s.head_k_dim),
            v.view(1, n, s.num_v_heads, s.head_v_dim), g[None], beta[None], self.scale, init, meta, pad)
        state.index_copy_(0, step["final_slots"], final.transpose(-1, -2).to(state.dtype))
        o = o[0].to(proj.dtype).reshape(n, s.value_dim)
        if isinstance(rows, slice):  # normalised straight into the layer output's rows
            gated_rms_norm(o, z[rows], weights.norm, s.norm_eps, head_dim=s.head_v_dim, out=out[rows])
        else:
            out.index_copy_(0, rows, gated_rms_norm(o, z[rows], weights.norm, s.norm_eps, head_dim=s.head_v_dim))


FLA_CHUNK = 64  # fla's chunk length for the gated delta rule


def chunk_rule(q, k, v, g, beta, scale: float, initial_state, meta: dict, pad: dict | None = None):
    """fla's chunked gated delta rule, forward only (what ``chunk_gated_delta_rule`` runs with
    ``use_qk_l2norm_in_kernel``, without its autograd Function, argument guards and backend
    dispatch: host time every layer), on the plan's own chunk indices and offsets. fla
    would otherwise derive them from ``cu_seqlens`` (a device sync a step) and keep them in an
    identity cache of 4 entries: a CUDA graph replaying a tensor that cache then drops reads
    freed memory. Returns (o [1, T, Hv, Dv] in q's dtype, final states [N, Hv, Dk, Dv] fp32).

    ``pad`` (sequences padded at their end, zero inputs there): per row ``real``, ``last`` (its
    fla chunk's last real row) and ``same`` (that chunk holds real rows). fla reads a chunk's
    decay at its last row, the sequence's last in a partial chunk; its cumulative sum is a
    parallel scan, so the padded chunk's last row holds the same sum in another association (other
    bits): padding rows take their chunk's last real row's value, or 0 in a chunk of padding."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    cu, indices = meta["cu"], meta["chunk_indices"]
    q, _ = l2norm_fwd(q)
    k, _ = l2norm_fwd(k)
    g = chunk_local_cumsum(g, chunk_size=FLA_CHUNK, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=indices)
    if pad is not None:
        fill = torch.where(pad["same"][:, None], g[0].index_select(0, pad["last"]), 0.0)
        g = torch.where(pad["real"][:, None], g[0], fill)[None]
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu, chunk_size=FLA_CHUNK,
                                               chunk_indices=indices)
    h, v_new, final = chunk_gated_delta_rule_fwd_h(
        k=k, w=w, u=u, g=g, initial_state=initial_state, output_final_state=True, chunk_size=FLA_CHUNK,
        cu_seqlens=cu, chunk_indices=indices, chunk_offsets=meta["chunk_offsets"])
    o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=cu, chunk_size=FLA_CHUNK,
                    chunk_indices=indices)
    return o.to(q.dtype), final
