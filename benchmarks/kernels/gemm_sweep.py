"""GEMM and grouped-GEMM tile sweeps at the Qwen3.5-35B-A3B shapes, for the sizes a throughput
run spends its time in: dense GEMMs at M = 256 (a full decode batch) and 7680 (a prefill
chunk), the expert GEMMs at decode batches 1 / 8 / 64 / 256 and a 7,680-token prefill. Every
config keeps BLOCK_K and SPLIT_K (the K order) as the tile table has them: only the speed knobs
move (BLOCK_M / BLOCK_N / warps / stages / INLINE), so any config found here can replace the
table's without changing a bit of output. cuBLAS is timed alongside as the speed reference.

python3 benchmarks/kernels/gemm_sweep.py [dense|mid|inline|moe|pair|tma|small|all] [--json out.jsonl]"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import triton

DEV = torch.device("cuda")
BF16 = torch.bfloat16
H, E, TOP_K, INTER = 2048, 256, 8, 512
DENSE = {"in_proj": (12352, 2048), "qkv": (9216, 2048), "out_proj": (2048, 4096), "lm_head": (248320, 2048)}
rows: list[dict] = []


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3  # us


def record(**row) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


def sweep_dense() -> None:
    from bi_core.kernels.gemm import gemm_config, linear

    tiles = [(64, 4), (128, 4), (128, 8)]  # (BLOCK_M, warps)
    for name, (n, k) in DENSE.items():
        w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
        for m in ((256,) if name == "lm_head" else (256, 7680)):
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            flop = 2 * m * n * k
            base = gemm_config(m, n, k)
            us_cublas = timed(partial(torch.matmul, x, w.T))
            us_table = timed(partial(linear, x, w))
            record(kind="dense", name=name, m=m, config="table", cfg=base, us=round(us_table, 2),
                   tflops=round(flop / us_table / 1e6, 1), cublas_us=round(us_cublas, 2),
                   cublas_tflops=round(flop / us_cublas / 1e6, 1))
            best = (us_table, "table")
            inlines = (False, True) if base["SPLIT_K"] > 1 else (False,)
            for (bm, warps), bn, stages, inline in itertools.product(tiles, (64, 128, 256), (3, 4), inlines):
                if bm == 128 and bn == 256 and warps == 4:
                    continue
                cfg = {**base, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
                       "INLINE": inline}
                try:
                    us = timed(partial(linear, x, w, config=cfg))
                except Exception as e:  # noqa: BLE001 - an unsupported tile is a sweep result
                    print(f"  {name} M={m} {cfg}: {type(e).__name__}", flush=True)
                    continue
                best = min(best, (us, json.dumps(cfg)))
                record(kind="dense-sweep", name=name, m=m, cfg=cfg, us=round(us, 2), tflops=round(flop / us / 1e6, 1))
            print(f"BEST dense {name} M={m}: {best[0]:.2f} us (table {us_table:.2f}, cuBLAS {us_cublas:.2f}) "
                  f"{best[1]}", flush=True)


def sweep_mid() -> None:
    """Dense GEMMs at large decode batches (65..256 rows): the tile table against a few tiles,
    the previous rule (128-row tiles, 8 warps, split programs) among them, and cuBLAS."""
    from bi_core.kernels.gemm import gemm_config, linear

    for name, (n, k) in DENSE.items():
        if name == "lm_head":
            continue
        w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
        for m in (96, 128, 192, 256):
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            base = gemm_config(m, n, k)
            us_cublas = timed(partial(torch.matmul, x, w.T))
            ref = linear(x, w)
            res = {}
            for label, bm, bn, warps, inline in [("table", 0, 0, 0, None), ("old-rule", 128, 64, 8, False),
                                                  ("128x128w4", 128, 128, 4, False), ("64x128", 64, 128, 4, False),
                                                  ("64x64", 64, 64, 4, False), ("64x64-inline", 64, 64, 4, True),
                                                  ("64x128-inline", 64, 128, 4, True)]:
                cfg = dict(base) if label == "table" else {**base, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps,
                                                           "num_stages": 3, "INLINE": inline and base["SPLIT_K"] > 1}
                us = timed(partial(linear, x, w, config=cfg))
                res[label] = round(us, 2)
                assert torch.equal(linear(x, w, config=cfg), ref), f"{name} M={m} {label}: bits differ"
            record(kind="dense-mid", name=name, m=m, table=base, us=res, cublas_us=round(us_cublas, 2))


def sweep_inline() -> None:
    """Split GEMMs (out_proj: K=4096 in 8 splits) from a decode batch to a prefill chunk: the
    table's config against split programs and INLINE (one program adds its tile's splits, its K
    loops flattened into one) at a few tiles; every variant must give the table's bits. The
    first run of this mode (FLAT on/off, before flattening became the only INLINE form) is in
    dev/results/gemm_sweep_inline_flat_h200.jsonl."""
    from bi_core.kernels.gemm import gemm_config, linear

    n, k = DENSE["out_proj"]
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
    tiles = {"128x128w8": (128, 128, 8), "128x64w8": (128, 64, 8), "64x128w4": (64, 128, 4), "64x64w4": (64, 64, 4)}
    for m in (160, 256, 320, 512, 768, 1024, 1536, 2048, 7680):
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        base = gemm_config(m, n, k)
        ref = linear(x, w)
        res = {"cublas": round(timed(partial(torch.matmul, x, w.T)), 2)}
        variants = {"table": {}, "split-programs": {"INLINE": False}}
        variants.update({f"inline-{name}": {"INLINE": True, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps,
                                            "num_stages": 3} for name, (bm, bn, warps) in tiles.items()})
        for label, over in variants.items():
            cfg = {**base, **over}
            res[label] = round(timed(partial(linear, x, w, config=cfg)), 2)
            assert torch.equal(linear(x, w, config=cfg), ref), f"out_proj M={m} {label}: bits differ"
        record(kind="inline", name="out_proj", m=m, table=base, us=res)


def sweep_tma(rows_m: tuple[int, ...] = ()) -> None:
    """Prefill-sized dense GEMMs (35B-A3B and 9B shapes; the 9B MLP's gate/up with SiLU-and-mul):
    the pointer-load kernel at the table's tiles against ``_gemm_tma_kernel`` (TMA tiles,
    optionally persistent) at a few tiles, cuBLAS alongside. Every TMA variant must give the
    pointer kernel's bits (the K order is the same)."""
    from bi_core.kernels.gemm import gemm_config, linear

    shapes = {**{k: (n, kk, False) for k, (n, kk) in DENSE.items() if k != "lm_head"}, "router": (257, 2048, False),
              "9b_gate_up": (12288, 4096, True), "9b_down": (4096, 12288, False)}
    if rows_m and min(rows_m) < 1024:  # a short prompt's prefill: the 9B's GEMMs alone
        shapes = {name: (n, k, silu) for name, (n, k, silu) in SMALL.items()}
    tiles = {"128x128w8s3": (128, 128, 8, 3), "128x128w8s4": (128, 128, 8, 4), "128x256w8s3": (128, 256, 8, 3),
             "128x64w4s4": (128, 64, 4, 4), "64x128w4s4": (64, 128, 4, 4), "64x256w8s3": (64, 256, 8, 3),
             "64x128w4s3": (64, 128, 4, 3), "64x64w4s4": (64, 64, 4, 4)}
    for name, (n, k, silu) in shapes.items():
        w = torch.randn((2 if silu else 1) * n, k, device=DEV, dtype=BF16) / k**0.5
        for m in rows_m or (1024, 4080, 7680):
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            base = gemm_config(m, n, k, silu_mul=silu)
            pointer = {**base, "TMA": False}
            ref = linear(x, w, silu_mul=silu, config=pointer)
            res = {"cublas": round(timed(partial(torch.matmul, x, w.T)), 2),
                   "pointer": round(timed(partial(linear, x, w, silu_mul=silu, config=pointer)), 2),
                   "table": round(timed(partial(linear, x, w, silu_mul=silu, config=base)), 2)}
            assert torch.equal(linear(x, w, silu_mul=silu, config=base), ref), f"{name} M={m}: table bits differ"
            for label, (bm, bn, warps, stages) in tiles.items():
                if silu and bn == 256:
                    continue
                for persistent in (False, True):
                    cfg = {**base, "TMA": True, "PERSISTENT": persistent, "BLOCK_M": bm,
                           "BLOCK_N": min(bn, max(16, triton.next_power_of_2(n))),
                           "num_warps": warps, "num_stages": stages - (1 if silu and stages > 3 else 0)}
                    key = f"tma-{label}{'-p' if persistent else ''}"
                    try:
                        same = torch.equal(linear(x, w, silu_mul=silu, config=cfg), ref)
                        res[key] = round(timed(partial(linear, x, w, silu_mul=silu, config=cfg)), 2)
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not a stop
                        res[key], same = f"error: {type(e).__name__}: {str(e)[:80]}", None
                    if same is False:
                        res[key] = f"BITS DIFFER ({res[key]})"
            flop = 2 * m * n * k * (2 if silu else 1)
            timed_ok = {kk: v for kk, v in res.items() if isinstance(v, float) and kk.startswith("tma")}
            best = min(timed_ok, key=timed_ok.get) if timed_ok else None
            record(kind="tma", name=name, m=m, split=base["SPLIT_K"], table=base, us=res, best=best,
                   tflops={kk: round(flop / v / 1e6) for kk, v in res.items() if isinstance(v, float)})


SMALL = {  # the 9B dense shapes (hidden 4096): (N, K, SiLU-and-mul)
    "9b_gdn_in_proj": (12352, 4096, False), "9b_attn_qkv": (10240, 4096, False), "9b_o_proj": (4096, 4096, False),
    "9b_gate_up": (12288, 4096, True), "9b_down": (4096, 12288, False)}
L2_DEFEAT_BYTES = 256 << 20  # weights rotated until a call's weight was last read this many bytes ago


def _rotating(x, ws, silu, cfg):
    """A call that takes the next weight copy each time (a CUDA graph captures each call's own)."""
    from bi_core.kernels.gemm import linear

    turn = [0]

    def fn():
        turn[0] = (turn[0] + 1) % len(ws)
        linear(x, ws[turn[0]], silu_mul=silu, config=cfg)
    return fn


def sweep_small() -> None:
    """Decode and verify row counts (M = 1, 4, 8, 32: AR B=1/8, MTP N=3 verify B=1/8) on the
    9B dense shapes: the table's tiles against BLOCK_M / BLOCK_N / warps / stages (the K order
    kept: every variant must give the table's bits). Weights rotate over copies so that no call
    finds its weight in L2, as in a model step; GB/s is the weight's bytes over the time."""
    from bi_core.kernels.gemm import gemm_config, linear

    for name, (n, k, silu) in SMALL.items():
        nbytes = (2 if silu else 1) * n * k * 2
        ws = [torch.randn((2 if silu else 1) * n, k, device=DEV, dtype=BF16) / k**0.5
              for _ in range(max(2, -(-L2_DEFEAT_BYTES // nbytes)))]
        for m in (1, 4, 8, 32):
            x = torch.randn(m, k, device=DEV, dtype=BF16)
            base = gemm_config(m, n, k, silu_mul=silu)
            ref = linear(x, ws[0], silu_mul=silu, config=base)

            res = {"table": round(timed(_rotating(x, ws, silu, base)), 2)}
            # 16-row tiles over 32 rows are two row tiles: a weight tile is read twice (the second from L2)
            for bm, bn, warps, stages in itertools.product((16, 32), (16, 32, 64), (2, 4), (3, 4)):
                cfg = {**base, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
                key = f"{bm}x{bn}w{warps}s{stages}"
                try:
                    if not torch.equal(linear(x, ws[0], silu_mul=silu, config=cfg), ref):
                        res[key] = "BITS DIFFER"
                        continue
                    res[key] = round(timed(_rotating(x, ws, silu, cfg)), 2)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not a stop
                    res[key] = f"error: {type(e).__name__}"
            timed_ok = {kk: v for kk, v in res.items() if isinstance(v, float)}
            best = min(timed_ok, key=timed_ok.get)
            record(kind="small", name=name, m=m, table=base, table_us=res["table"], best=best,
                   best_us=res[best], table_gbs=round(nbytes / res["table"] / 1e3), best_gbs=round(nbytes / res[best] / 1e3),
                   us=res)


def sweep_moe() -> None:
    from bi_core.kernels.moe import align, grouped_config, grouped_gemm
    from bi_core.kernels.topk import softmax_topk

    w13 = torch.randn(E + 1, 2 * INTER, H, device=DEV, dtype=BF16) / H**0.5
    w2 = torch.randn(E + 1, H, INTER, device=DEV, dtype=BF16) / INTER**0.5
    router = torch.randn(E, H, device=DEV, dtype=BF16) / H**0.5
    for t in (1, 8, 64, 256, 7680):
        x = torch.randn(t, H, device=DEV, dtype=BF16)
        _, ids = softmax_topk(x @ router.T, TOP_K)
        routing = align(ids, E + 1, shared=True)
        hit = E * (1 - (1 - TOP_K / E) ** t) + 1
        h = grouped_gemm(x, w13, routing, a_row_div=routing.slots, silu_mul=True)
        for gemm, (w, a, div, silu, n) in {"w13": (w13, x, routing.slots, True, INTER),
                                            "w2": (w2, h, 1, False, H)}.items():
            nbytes = int(hit * w.shape[1] * w.shape[2] * 2)
            base = grouped_config(routing.block_m, n, silu)
            us_table = timed(partial(grouped_gemm, a, w, routing, div, silu))
            record(kind="moe", gemm=gemm, tokens=t, block_m=routing.block_m, config="table", cfg=base,
                   us=round(us_table, 2), tb_s=round(nbytes / us_table / 1e6, 2))
            best = (us_table, "table")
            big = routing.block_m >= 64
            for bn, warps, stages in itertools.product((32, 64, 128), (4, 8) if big else (2, 4),
                                                       (2, 3, 4) if big else (3, 4, 5)):
                cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
                try:
                    us = timed(partial(grouped_gemm, a, w, routing, div, silu, config=cfg))
                except Exception as e:  # noqa: BLE001 - an unsupported tile is a sweep result
                    print(f"  {gemm} T={t} {cfg}: {type(e).__name__}", flush=True)
                    continue
                best = min(best, (us, json.dumps(cfg)))
                record(kind="moe-sweep", gemm=gemm, tokens=t, block_m=routing.block_m, cfg=cfg, us=round(us, 2),
                       tb_s=round(nbytes / us / 1e6, 2))
            print(f"BEST moe {gemm} T={t} (BLOCK_M {routing.block_m}): {best[0]:.2f} us (table {us_table:.2f}) "
                  f"{best[1]}", flush=True)


def sweep_pair() -> None:
    """The small-batch MoE path (per pair, combine fused) against the sorted path, whole MoE
    (router logits given), and its two kernels' tiles."""
    from bi_core.kernels.moe import PAIR_DOWN, PAIR_UP, _moe_per_pair, _moe_sorted
    from bi_core.kernels.topk import softmax_topk

    w13 = torch.randn(E + 1, 2 * INTER, H, device=DEV, dtype=BF16) / H**0.5
    w2 = torch.randn(E + 1, H, INTER, device=DEV, dtype=BF16) / INTER**0.5
    router = torch.randn(E + 1, H, device=DEV, dtype=BF16) / H**0.5
    for t in (1, 2, 4, 8, 16):
        x = torch.randn(t, H, device=DEV, dtype=BF16)
        logits = x @ router.T
        wts, ids = softmax_topk(logits[:, :E], TOP_K)
        gate = logits[:, E]
        us_sorted = timed(partial(_moe_sorted, x, wts, ids, w13, w2, gate))
        us_pair = timed(partial(_moe_per_pair, x, wts, ids, w13, w2, gate))
        same = torch.equal(_moe_sorted(x, wts, ids, w13, w2, gate), _moe_per_pair(x, wts, ids, w13, w2, gate))
        record(kind="pair", tokens=t, sorted_us=round(us_sorted, 2), pair_us=round(us_pair, 2), bitwise_equal=same)
        best = {"up": (us_pair, PAIR_UP), "down": (us_pair, PAIR_DOWN)}
        for which in ("up", "down"):
            for bn, warps, stages in itertools.product((16, 32, 64), (2, 4), (3, 4, 5)):
                cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
                kw = {which: cfg}
                try:
                    us = timed(partial(_moe_per_pair, x, wts, ids, w13, w2, gate, **kw))
                except Exception as e:  # noqa: BLE001 - an unsupported tile is a sweep result
                    print(f"  pair {which} T={t} {cfg}: {type(e).__name__}", flush=True)
                    continue
                best[which] = min(best[which], (us, cfg), key=lambda b: b[0])
                record(kind="pair-sweep", which=which, tokens=t, cfg=cfg, us=round(us, 2))
        print(f"BEST pair T={t}: sorted {us_sorted:.2f} us, per pair {us_pair:.2f} us (bitwise equal: {same}); "
              f"up {best['up']}, down {best['down']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="all", choices=["dense", "mid", "inline", "moe", "pair", "tma", "small", "all"])
    ap.add_argument("--json")
    ap.add_argument("--m", help="tma: these row counts (e.g. 512,3968) instead of 1024,4080,7680; under 1024 "
                    "the 9B shapes alone")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    if args.what in ("pair", "all"):
        sweep_pair()
    if args.what in ("moe", "all"):
        sweep_moe()
    if args.what in ("dense", "all"):
        sweep_dense()
    if args.what in ("mid", "all"):
        sweep_mid()
    if args.what in ("inline", "all"):
        sweep_inline()
    if args.what in ("tma", "all"):
        sweep_tma(tuple(int(x) for x in args.m.split(",")) if args.m else ())
    if args.what == "small":
        sweep_small()
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
