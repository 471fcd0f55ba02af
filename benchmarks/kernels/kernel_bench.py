"""Per-kernel decode timings at the Qwen3.5-35B-A3B shapes (B = 1, 8, 64), for before/after
comparisons of each change: run it with the current tree and with an older one first on
PYTHONPATH (``dev/gpu/gpu_run.sh compare`` does both in one device call). Each timing is a
CUDA-graph replay median (``triton.testing.do_bench_cudagraph``), so launch gaps do not count;
bytes are the fewest a kernel group must move, for an achieved-bandwidth column.

python3 benchmarks/kernels/kernel_bench.py [--sweep] [--json out.jsonl]"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math

import torch
import triton

NEW = importlib.util.find_spec("bi_core.kernels.gdn_decode") is not None
DEV = torch.device("cuda")
BF16 = torch.bfloat16
H, E, TOP_K, INTER = 2048, 256, 8, 512
HQ, HKV, D = 16, 2, 256
HK, HV, DK, DV = 16, 32, 128, 128
GEMMS = {"in_proj": (12352, 2048), "out_proj": (2048, 4096), "qkv": (9216, 2048), "router": (256 + NEW, 2048),
         "lm_head": (248320, 2048)}
rows: list[dict] = []


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3  # us


def record(group: str, name: str, batch: int, us: float, nbytes: int, **extra) -> None:
    row = {"tree": "new" if NEW else "old", "group": group, "kernel": name, "batch": batch, "us": round(us, 2),
           "tb_s": round(nbytes / us / 1e6, 3), **extra}
    rows.append(row)
    print(json.dumps(row), flush=True)


def bench_gemm(sweep: bool) -> None:
    from bi_core.kernels.gemm import linear

    for name, (n, k) in GEMMS.items():
        w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
        for b in (1, 8, 64):
            x = torch.randn(b, k, device=DEV, dtype=BF16)
            nbytes = 2 * (n * k + b * k + b * n)
            record("gemm", name, b, timed(lambda: linear(x, w)), nbytes)
            if NEW:
                record("gemm", name + ":cublas", b, timed(lambda: x @ w.T), nbytes)
        if NEW and sweep:
            x = torch.randn(1, k, device=DEV, dtype=BF16)
            for bn in (16, 32, 64):
                for bk in (64, 128, 256):
                    for split in (1, 2, 4, 8, 16):
                        if k // split < 256 or k % (split * bk):
                            continue
                        for warps, stages in ((4, 4), (4, 5), (2, 4)):
                            cfg = {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split,
                                   "num_warps": warps, "num_stages": stages}
                            try:
                                us = timed(lambda: linear(x, w, config=cfg))
                            except Exception as e:  # noqa: BLE001 - an unsupported tile is a sweep result
                                print(f"  sweep {name} {cfg}: {type(e).__name__}", flush=True)
                                continue
                            record("gemm-sweep", name, 1, us, 2 * n * k, config=cfg)


def _ctx(batch: int, ctx_len: int, q_len: int = 1):
    from bi_core.runtime.batch import build_context

    per = math.ceil(ctx_len / 16)
    blocks = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    _, ctx = build_context([[0] * q_len] * batch, [ctx_len - q_len] * batch, blocks, list(range(batch)),
                           [True] * batch, block_size=16, device=DEV)
    return ctx, batch * per


def bench_attention() -> None:
    for b in (1, 8, 64):
        for n in (512, 3500, 7500):
            ctx, pages = _ctx(b, n)
            kc = torch.randn(pages + 1, 16, HKV, D, device=DEV, dtype=BF16)
            vc = torch.randn_like(kc)
            q = torch.randn(b, HQ, D, device=DEV, dtype=BF16)
            nbytes = 2 * b * n * HKV * D * 2
            if NEW:
                from bi_core.backends.cuda_common.attention import TritonPagedAttentionImpl
                from bi_core.kernels.attention import decode_attention
                from bi_core.ops.attention import AttentionSpec

                spec = AttentionSpec(dtype=BF16, device=DEV, num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                     scale=D**-0.5, rotary_dim=64, rope_theta=1e7, norm_eps=1e-6)
                plan = TritonPagedAttentionImpl(spec).prepare(ctx)
                gate = torch.randn(b, 2 * HQ * D, device=DEV, dtype=BF16)[:, D:]
                out = torch.empty(b, HQ * D, device=DEV, dtype=BF16)
                us = timed(lambda: decode_attention(q, kc, vc, gate, out, ctx.block_tables, ctx.context_lens,
                                                    ctx.cu_seqlens_q, plan.dec_seqs, D**-0.5, 1, plan.splits))
                record("attention", "decode split+merge+gate", b, us, nbytes, context=n)
                _flashinfer(b, n, kc, vc, q, ctx, nbytes)
            else:
                from bi_core.kernels.attention import make_tiles, paged_attention, tokens_per_tile

                seqs, starts = make_tiles([1] * b, tokens_per_tile(HQ, HKV), DEV)
                us = timed(lambda: paged_attention(q, kc, vc, ctx.block_tables, ctx.context_lens, ctx.cu_seqlens_q,
                                                   seqs, starts, D**-0.5))
                record("attention", "paged (one program per head)", b, us, nbytes, context=n)


def bench_attention_sweep() -> None:
    """Decode attention configs (split size and BLOCK_N are part of a row's arithmetic: one of
    them is chosen and fixed; warps, stages and tile rows are scheduling)."""
    from bi_core.backends.cuda_common.attention import TritonPagedAttentionImpl
    from bi_core.kernels import attention as A
    from bi_core.ops.attention import AttentionSpec

    spec = AttentionSpec(dtype=BF16, device=DEV, num_heads=HQ, num_kv_heads=HKV, head_dim=D, scale=D**-0.5,
                         rotary_dim=64, rope_theta=1e7, norm_eps=1e-6)
    saved = (A.KV_SPLIT, A.BLOCK_N, A.DECODE_WARPS, A.DECODE_STAGES, A.DECODE_MIN_ROWS)
    cases = []
    for b, n in ((1, 512), (1, 3500), (8, 3500), (64, 3500)):
        ctx, pages = _ctx(b, n)
        kc = torch.randn(pages + 1, 16, HKV, D, device=DEV, dtype=BF16)
        cases.append((b, n, ctx, kc, torch.randn_like(kc), torch.randn(b, HQ, D, device=DEV, dtype=BF16)))
    for split in (128, 256, 512):
        for block_n in (32, 64):
            for warps, stages in ((4, 2), (4, 3), (8, 2)):
                for rows in (16, 64):
                    A.KV_SPLIT, A.BLOCK_N, A.DECODE_WARPS, A.DECODE_STAGES, A.DECODE_MIN_ROWS = \
                        split, block_n, warps, stages, rows
                    cfg = dict(split=split, block_n=block_n, warps=warps, stages=stages, rows=rows)
                    for b, n, ctx, kc, vc, q in cases:
                        plan = TritonPagedAttentionImpl(spec).prepare(ctx)
                        gate = torch.randn(b, 2 * HQ * D, device=DEV, dtype=BF16)[:, D:]
                        out = torch.empty(b, HQ * D, device=DEV, dtype=BF16)
                        try:
                            us = timed(lambda: A.decode_attention(q, kc, vc, gate, out, ctx.block_tables,
                                                                  ctx.context_lens, ctx.cu_seqlens_q, plan.dec_seqs,
                                                                  D**-0.5, 1, plan.splits))
                        except Exception as e:  # noqa: BLE001 - an unsupported config is a sweep result
                            print(f"  sweep attention {cfg}: {type(e).__name__}", flush=True)
                            continue
                        record("attn-sweep", f"B{b} ctx{n}", b, us, 2 * b * n * HKV * D * 2, config=cfg, context=n)
    A.KV_SPLIT, A.BLOCK_N, A.DECODE_WARPS, A.DECODE_STAGES, A.DECODE_MIN_ROWS = saved


def _flashinfer(b, n, kc, vc, q, ctx, nbytes) -> None:
    try:
        import flashinfer
    except ImportError:
        return
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    per = math.ceil(n / 16)
    indptr = torch.arange(0, (b + 1) * per, per, dtype=torch.int32, device=DEV)
    indices = torch.arange(b * per, dtype=torch.int32, device=DEV)
    last = torch.full((b,), n - (per - 1) * 16, dtype=torch.int32, device=DEV)
    wrapper.plan(indptr, indices, last, HQ, HKV, D, 16, q_data_type=BF16)
    record("attention", "flashinfer decode (cuda_default)", b, timed(lambda: wrapper.run(q, (kc, vc))), nbytes,
           context=n)


def bench_qk_rope() -> None:
    for b in (1, 64):
        ctx, pages = _ctx(b, 512)
        kc = torch.randn(pages + 1, 16, HKV, D, device=DEV, dtype=BF16)
        vc = torch.randn_like(kc)
        qkv = torch.randn(b, 2 * HQ * D + 2 * HKV * D, device=DEV, dtype=BF16)
        qn, kn = (0.1 * torch.randn(D, device=DEV, dtype=BF16) for _ in range(2))
        nbytes = qkv.numel() * 2 + b * HQ * D * 2 + b * 2 * HKV * D * 2
        if NEW:
            from bi_core.kernels.qk_norm_rope import qk_norm_rope_write

            inv = 1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float32, device=DEV) / 64))
            us = timed(lambda: qk_norm_rope_write(qkv, qn, kn, inv, ctx.positions, ctx.slot_mapping, kc, vc, HQ,
                                                  1e-6, 64))
            record("attn-pre", "q/k norm + RoPE + KV write (1 kernel)", b, us, nbytes)
        else:
            from bi_core.backends.reference.attention import write_kv
            from bi_core.kernels.norm import rms_norm
            from bi_core.models.presets import preset_args
            from bi_core.models.qwen3_5 import Rope
            rope = Rope(preset_args("qwen3.5-35b-a3b", 4), DEV)

            def old():  # the old Attention.forward up to the attention kernel (torch RoPE)
                qg = qkv[:, : 2 * HQ * D].view(b, HQ, 2 * D)
                q, k = qg[..., :D], qkv[:, 2 * HQ * D: 2 * HQ * D + HKV * D].view(b, HKV, D)
                v = qkv[:, 2 * HQ * D + HKV * D:].view(b, HKV, D)
                q, k = rms_norm(q.contiguous(), qn, 1e-6), rms_norm(k.contiguous(), kn, 1e-6)
                cos, sin = rope.cos_sin(ctx.positions, BF16)
                q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
                write_kv(k, v.contiguous(), kc, vc, ctx.slot_mapping)
                return q

            record("attn-pre", "q/k norm (Triton) + RoPE (torch) + KV write (torch)", b, timed(old), nbytes)


def bench_gdn() -> None:
    conv_dim, value_dim = 2 * HK * DK + HV * DV, HV * DV
    for b in (1, 8, 64):
        ctx, _ = _ctx(b, 600)
        proj = torch.randn(b, conv_dim + value_dim + 2 * HV, device=DEV, dtype=BF16)
        conv_w = (torch.randn(conv_dim, 4, device=DEV) / 2).to(BF16)
        a_log, dt_bias = torch.rand(HV, device=DEV), torch.randn(HV, device=DEV)
        norm_w = torch.ones(DV, device=DEV, dtype=BF16)
        conv = torch.randn(b, conv_dim, 3, device=DEV, dtype=BF16)
        state = torch.randn(b, HV, DV, DK, device=DEV)
        nbytes = 2 * state.numel() * 4 + 2 * conv.numel() * 2 + proj.numel() * 2 + b * value_dim * 2
        if NEW:
            from bi_core.kernels import gdn_decode as gd

            out = torch.empty(b, value_dim, device=DEV, dtype=BF16)
            for warps in (4, 8, 16):
                gd.NUM_WARPS = warps
                us = timed(lambda: gd.gdn_decode(proj, conv_w, a_log, dt_bias, norm_w, conv, state, ctx.cu_seqlens_q,
                                                 ctx.context_lens, ctx.state_slots, ctx.token_state_slots,
                                                 ctx.recurrent_ids, out, num_k_heads=HK, head_k_dim=DK, eps=1e-6,
                                                 per_token=False))
                record("gdn", f"recurrent decode ({warps} warps)", b, us, nbytes)
            gd.NUM_WARPS = 8
        else:
            import torch.nn.functional as F
            from bi_core.kernels.gdn_recurrent import gdn_recurrent

            from bi_core.kernels.conv1d import causal_conv1d
            from bi_core.kernels.norm import gated_rms_norm

            def old():  # the old GatedDeltaNet.forward between in_proj and out_proj
                mixed, z, bb, a = torch.split(proj, [conv_dim, value_dim, HV, HV], dim=-1)
                mixed = causal_conv1d(mixed.contiguous(), conv_w, conv, ctx.cu_seqlens_q, ctx.context_lens,
                                      ctx.state_slots, ctx.token_state_slots)
                q, k, v = torch.split(mixed, [HK * DK, HK * DK, value_dim], dim=-1)
                beta = torch.sigmoid(bb)
                g = -a_log.exp() * F.softplus(a.float() + dt_bias)
                o = torch.empty(b, HV, DV, device=DEV, dtype=BF16)
                gdn_recurrent(q.reshape(b, HK, DK), k.reshape(b, HK, DK), v.reshape(b, HV, DV), g, beta, state,
                              ctx.cu_seqlens_q, ctx.context_lens, ctx.state_slots, ctx.token_state_slots,
                              seq_ids=ctx.recurrent_ids, out=o)
                return gated_rms_norm(o.reshape(-1, DV), z.reshape(-1, DV), norm_w, 1e-6)

            record("gdn", "conv + torch gates + recurrent + gated norm", b, timed(old), nbytes)


def bench_moe() -> None:
    from bi_core.kernels.gemm import linear
    from bi_core.kernels.topk import softmax_topk

    w13 = torch.randn(E + 1, 2 * INTER, H, device=DEV, dtype=BF16) / H**0.5
    w2 = torch.randn(E + 1, H, INTER, device=DEV, dtype=BF16) / INTER**0.5
    router = torch.randn(E + 1, H, device=DEV, dtype=BF16) / H**0.5
    for b in (1, 8, 64):
        x = torch.randn(b, H, device=DEV, dtype=BF16)
        hit = E * (1 - (1 - TOP_K / E) ** b) + 1
        nbytes = int(hit * 3 * INTER * H * 2) + router.numel() * 2
        if NEW:
            from bi_core.kernels.moe import fused_moe

            def new():
                logits = linear(x, router)
                wts, ids = softmax_topk(logits[:, :E], TOP_K)
                return fused_moe(x, wts, ids, w13, w2, logits[:, E])

            record("moe", "router+shared gate GEMM, top-k, align, 2 grouped GEMMs, combine", b, timed(new), nbytes)
        else:
            from bi_core.kernels.elementwise import silu_mul
            from bi_core.kernels.moe import fused_moe

            r_w, s_gate = router[:E].contiguous(), router[E:].contiguous()
            s13, s2 = w13[E].contiguous(), w2[E].contiguous()
            r13, r2 = w13[:E], w2[:E]

            def old():  # the old SparseMoE.forward
                wts, ids = softmax_topk(linear(x, r_w), TOP_K)
                routed = fused_moe(x, wts, ids, r13, r2)
                shared = linear(silu_mul(linear(x, s13)), s2)
                return routed + torch.sigmoid(linear(x, s_gate)) * shared

            record("moe", "router, top-k, torch align, 2 grouped GEMMs, silu, combine, shared MLP", b, timed(old),
                   nbytes)


def bench_sampler() -> None:
    from bi_core.backends.cuda_common.sampling import CudaSamplerImpl
    from bi_core.ops.sampling import SamplingBatch

    for b in (1, 64):
        logits = torch.randn(b, 248320, device=DEV, dtype=BF16)
        batch = SamplingBatch(temperatures=[0.8] * b, top_ks=[0] * b, top_ps=[1.0] * b, keys=list(range(b)),
                              num_logprobs=0)
        impl = CudaSamplerImpl()

        def host():
            out = impl.forward(logits, batch)
            if NEW:
                return out.to_host()
            return torch.cat([out.token_ids[:, None].double(), out.logprobs[:, None].double(),
                              out.top_ids.double(), out.top_logprobs.double()], dim=1).cpu()

        host()
        us = triton.testing.do_bench(host, rep=100, return_mode="median") * 1e3  # host sync included
        record("sampler", "sample + logprob + one D2H (wall, eager)", b, us, b * 248320 * 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="GEMM tile/split sweep at M=1 (current tree)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} tree={'new' if NEW else 'old'}", flush=True)
    groups = [bench_gemm, bench_attention, bench_qk_rope, bench_gdn, bench_moe, bench_sampler]
    if NEW and args.sweep:
        groups.append(bench_attention_sweep)
    for fn in groups:
        try:
            fn(args.sweep) if fn is bench_gemm else fn()
        except Exception as e:  # noqa: BLE001 - report and go on to the next group
            print(json.dumps({"tree": "new" if NEW else "old", "group": fn.__name__, "error": repr(e)[:400]}), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
