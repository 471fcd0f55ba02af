"""Probe: the decode split kernel with its chunk loop and block loop made one loop (issue 22).

The shipped ``_decode_split_kernel`` runs an inner pipelined loop over a chunk's 8 blocks of 32
keys inside an outer loop over the program's chunks, so the software pipeline drains and refills
at every chunk. Here one ``tl.range`` runs over all the program's blocks; a chunk's state is
stored and reset after its last block. A row's arithmetic is the same (the same blocks in the same
order from a fresh state per chunk; blocks past the context are discarded with a select, so they
change no bit): every variant is checked bitwise against the shipped kernel, and timed with
the split count swept (programs a wave: ``--resident``).

    python3 benchmarks/split_flat_probe.py [--contexts 32000,131000] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from attention_long import HKV, HQ, PAGE, D, kernel_times

import bi_core.kernels.attention as attn
from bi_core.kernels.attention import _attend_chunk, _chunks_before, _slot_of
from bi_core.kernels.common import mma, pdl_start


@triton.jit
def _split_flat_kernel(Q, KC, VC, WS_ACC, WS_M, WS_L, BT, CTX, CU, DEC_SEQS, scale_log2,
                       stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_bt, num_heads,
                       PAGE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, M_ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, KV_SPLIT: tl.constexpr, DECODE_TOKENS: tl.constexpr,
                       BLOCK_B: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr, STORE_IF: tl.constexpr,
                       PDL: tl.constexpr, pdl_early):
    pdl_start(PDL, pdl_early)
    i = tl.program_id(0)
    p = tl.program_id(1)
    kvh = tl.program_id(2)
    num_p = tl.num_programs(1)
    s = tl.load(DEC_SEQS + i).to(tl.int64)
    q_start = tl.load(CU + s)
    q_len = tl.load(CU + s + 1) - q_start
    ctx = tl.load(CTX + s)
    past = ctx - q_len
    r = tl.arange(0, M_ROWS)
    tok = r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = tok < q_len
    pos = past + tok
    d = tl.arange(0, D)
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    slot0 = _chunks_before(CTX, CU, DEC_SEQS, i, KV_SPLIT, DECODE_TOKENS, BLOCK_B) + \
        _slot_of(past, tok, KV_SPLIT, DECODE_TOKENS)
    BPC: tl.constexpr = KV_SPLIT // BLOCK_N
    mine = tl.maximum(tl.cdiv(tl.cdiv(ctx, KV_SPLIT) - p, num_p), 0)
    bt_row = BT + s * stride_bt
    m_i = tl.full((M_ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_ROWS,), tl.float32)
    acc = tl.zeros((M_ROWS, D), tl.float32)
    for it in tl.range(0, mine * BPC, num_stages=STAGES):
        j = it % BPC
        c = p + (it // BPC) * num_p
        lo = c * KV_SPLIT
        hi = tl.minimum(lo + KV_SPLIT, ctx)
        n0 = lo + j * BLOCK_N
        idx = n0 + tl.arange(0, BLOCK_N)
        in_kv = idx < hi
        page = tl.load(bt_row + idx // PAGE, mask=in_kv, other=0).to(tl.int64)
        off = page * stride_kb + (idx % PAGE) * stride_ko + kvh * stride_kh
        k = tl.load(KC + off[:, None] + d[None, :], mask=in_kv[:, None], other=0.0)
        v = tl.load(VC + off[:, None] + d[None, :], mask=in_kv[:, None], other=0.0)
        scores = mma(q, tl.trans(k), tl.zeros((M_ROWS, BLOCK_N), tl.float32), DOT) * scale_log2
        visible = (idx[None, :] <= pos[:, None]) & in_kv[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(scores - m_safe[:, None])
        l_new = l_i * alpha + tl.sum(pr, axis=1)
        acc_new = mma(pr.to(v.dtype), v, acc * alpha[:, None], DOT)
        live = n0 < hi  # a block past the context (the last chunk's tail): discarded, exactly
        m_i = tl.where(live, m_new, m_i)
        l_i = tl.where(live, l_new, l_i)
        acc = tl.where(live, acc_new, acc)
        last = j == BPC - 1
        keep = row_ok & (pos >= lo)
        unit = ((slot0 + c) * num_heads + head).to(tl.int64)
        if STORE_IF:
            if last:
                tl.store(WS_M + unit, m_i, mask=keep)
                tl.store(WS_L + unit, l_i, mask=keep)
                tl.store(WS_ACC + unit[:, None] * D + d[None, :], acc, mask=keep[:, None])
        else:
            keep_last = keep & ((r * 0 + j) == BPC - 1)
            tl.store(WS_M + unit, m_i, mask=keep_last)
            tl.store(WS_L + unit, l_i, mask=keep_last)
            tl.store(WS_ACC + unit[:, None] * D + d[None, :], acc, mask=keep_last[:, None])
        m_i = tl.where(last, float("-inf"), m_i)
        l_i = tl.where(last, 0.0, l_i)
        acc = tl.where(last, 0.0, acc)


@triton.jit
def _split_kvh_fast_kernel(Q, KC, VC, WS_ACC, WS_M, WS_L, BT, CTX, CU, DEC_SEQS, scale_log2,
                           stride_qt, stride_qh, stride_kb, stride_ko, stride_kh, stride_bt, num_heads,
                           PAGE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, M_ROWS: tl.constexpr,
                           BLOCK_N: tl.constexpr, KV_SPLIT: tl.constexpr, DECODE_TOKENS: tl.constexpr,
                           BLOCK_B: tl.constexpr, DOT: tl.constexpr, SEQ_AXIS: tl.constexpr, PDL: tl.constexpr,
                           pdl_early):
    """The shipped split kernel, its programs ordered KV head fastest: a token's two KV heads (adjacent
    512-byte halves of its 1 KB row) are read by neighbouring programs at the same time."""
    pdl_start(PDL, pdl_early)
    kvh = tl.program_id(0)
    if SEQ_AXIS == 1:
        i = tl.program_id(1)
        p = tl.program_id(2)
        num_p = tl.num_programs(2)
    else:
        i = tl.program_id(2)
        p = tl.program_id(1)
        num_p = tl.num_programs(1)
    s = tl.load(DEC_SEQS + i).to(tl.int64)
    q_start = tl.load(CU + s)
    q_len = tl.load(CU + s + 1) - q_start
    ctx = tl.load(CTX + s)
    past = ctx - q_len
    r = tl.arange(0, M_ROWS)
    tok = r // GROUP
    head = kvh * GROUP + r % GROUP
    row_ok = tok < q_len
    pos = past + tok
    d = tl.arange(0, D)
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    slot0 = _chunks_before(CTX, CU, DEC_SEQS, i, KV_SPLIT, DECODE_TOKENS, BLOCK_B) + \
        _slot_of(past, tok, KV_SPLIT, DECODE_TOKENS)
    for c in range(p, tl.cdiv(ctx, KV_SPLIT), num_p):
        lo = c * KV_SPLIT
        m, l_c, acc = _attend_chunk(q, KC, VC, BT + s * stride_bt, kvh, pos, lo, tl.minimum(lo + KV_SPLIT, ctx),
                                  scale_log2, stride_kb, stride_ko, stride_kh, PAGE, D, M_ROWS, BLOCK_N, DOT)
        keep = row_ok & (pos >= lo)
        unit = ((slot0 + c) * num_heads + head).to(tl.int64)
        tl.store(WS_M + unit, m, mask=keep)
        tl.store(WS_L + unit, l_c, mask=keep)
        tl.store(WS_ACC + unit[:, None] * D + d[None, :], acc, mask=keep[:, None])


def _record(kernel, seen: dict):
    """Registers, spills and shared memory of a launched kernel (occupancy: the split kernel is
    bound by how many programs an SM holds)."""
    try:
        seen.update(n_regs=kernel.n_regs, n_spills=kernel.n_spills, shared=kernel.metadata.shared)
    except Exception:  # noqa: BLE001 - metadata is a report, not a result
        pass
    return kernel


def capture(jit_fn, seen: dict):
    """``jit_fn`` with the shipped launch signature, recording the compiled kernel's metadata."""
    class _Launch:
        def __getitem__(self, grid):
            return lambda *args, **kw: _record(jit_fn[grid](*args, **kw), seen)
    return _Launch()


def flat_split(stages: int, store_if: bool, seen: dict):
    """A stand-in for ``attn._decode_split_kernel`` with the shipped launch signature."""
    class _Launch:
        def __getitem__(self, grid):
            def launch(*args, num_stages=None, **kw):
                return _record(_split_flat_kernel[grid](*args, STAGES=stages, STORE_IF=store_if, num_stages=1, **kw),
                               seen)
            return launch
    return _Launch()


def kvh_fast(seq_axis: int, seen: dict):
    """``_split_kvh_fast_kernel`` launched on the shipped grid (sequences, splits, KV heads) permuted."""
    class _Launch:
        def __getitem__(self, grid):
            num_dec, splits, kvh = grid
            g = (kvh, num_dec, splits) if seq_axis == 1 else (kvh, splits, num_dec)
            return lambda *args, **kw: _record(_split_kvh_fast_kernel[g](*args, SEQ_AXIS=seq_axis, **kw), seen)
    return _Launch()


def case(batch: int, context: int, variants: list) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    pages = -(-context // PAGE)
    kc = torch.randn(batch * pages, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(kc.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = torch.randn(batch, 2 * HQ * D, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
    # unequal contexts too: the last chunk of each sequence partial at a different place
    ctx = torch.tensor([context - 37 * b for b in range(batch)], dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    dec = torch.arange(batch, dtype=torch.int64, device="cuda")
    chunks = batch * -(-context // attn.KV_SPLIT)
    gbytes = float(ctx.sum()) * HKV * D * 2 * 2 / 1e9
    shipped_kernel = attn._decode_split_kernel
    saved = (attn.BLOCK_N, attn.DECODE_WARPS, attn.DECODE_STAGES)
    rows, ref = [], None
    for name, splits, stages, warps, block_n in variants(batch, context):
        out = torch.full((batch, HQ * D), float("nan"), device="cuda", dtype=torch.bfloat16)
        seen = {}
        if name == "shipped":
            attn._decode_split_kernel = capture(shipped_kernel, seen)
        elif name.startswith("kvh-fast"):
            attn._decode_split_kernel = kvh_fast(1 if name == "kvh-fast-seq" else 2, seen)
        else:
            attn._decode_split_kernel = flat_split(stages, name == "flat-if", seen)
        attn.BLOCK_N, attn.DECODE_WARPS, attn.DECODE_STAGES = block_n, warps, stages

        def run(out=out, splits=splits):
            attn.decode_attention(q, kc, vc, gate, out, bt, ctx, cu, dec, D**-0.5, 1, splits, chunks)

        try:
            times = kernel_times(run)
            split_us = sum(v for k, v in times.items() if "split" in k)
            merge_us = sum(v for k, v in times.items() if "merge" in k)
            if ref is None:
                ref = out.clone()
            rows.append({"batch": batch, "context": context, "variant": name, "splits": splits,
                         "programs": splits * batch * HKV, "stages": stages, "warps": warps, "block_n": block_n,
                         "split_us": round(split_us, 1), "merge_us": round(merge_us, 1),
                         "split_TBps": round(gbytes / split_us * 1e3, 3), **seen,
                         "bitwise_same_as_shipped": bool(torch.equal(out, ref))})
        except Exception as e:  # a variant that does not compile is reported, not fatal
            rows.append({"batch": batch, "context": context, "variant": name, "splits": splits,
                         "error": f"{type(e).__name__}: {str(e)[:300]}"})
        finally:
            attn._decode_split_kernel = shipped_kernel
            attn.BLOCK_N, attn.DECODE_WARPS, attn.DECODE_STAGES = saved
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131000,32000")
    ap.add_argument("--batches", default="8,1,32")
    ap.add_argument("--resident", type=int, default=528,
                    help="split programs resident at once (a wave: 4 an SM, by registers)")
    ap.add_argument("--flat", action="store_true", help="the one-loop kernel too")
    ap.add_argument("--same-bits-only", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()

    def variants(batch, context):
        chunks = -(-context // attn.KV_SPLIT)
        shipped = max(1, min(chunks, max(-(-264 // (batch * HKV)), -(-context // (attn.KV_SPLIT * 4)))))
        every = chunks
        wave = max(1, min(chunks, max(-(-a.resident // (batch * HKV)), -(-context // (attn.KV_SPLIT * 4)))))
        out = [("shipped", shipped, 2, 2, 32), ("shipped", wave, 2, 2, 32), ("shipped", every, 2, 2, 32)]
        for sp in sorted({shipped, wave}):
            out += [("kvh-fast-seq", sp, 2, 2, 32), ("kvh-fast-split", sp, 2, 2, 32)]
        if a.flat:
            out += [("flat-if", shipped, 2, 2, 32)]
        if not a.same_bits_only:  # other bits: timed for scale, and their bits reported
            for sp in (shipped, every):
                out += [("shipped", sp, 2, 2, 16), ("shipped", sp, 3, 2, 16), ("shipped", sp, 2, 4, 32),
                        ("shipped", sp, 2, 1, 32), ("shipped", sp, 2, 1, 16)]
        return out

    rows = []
    for context in (int(c) for c in a.contexts.split(",")):
        for batch in (int(b) for b in a.batches.split(",")):
            rows += case(batch, context, variants)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
