"""Block-FP8 linear kernels at the 35B-A3B shape's dense GEMMs, one H200/H100 call: fp8_linear as
configured (quantize_act, then the GEMM), quantize_act alone, and the bf16 Triton GEMM for
comparison; microseconds per call (CUDA graphs of
20 calls: launch gaps inside a graph do count, as in the engine's graphs), and each one's weight
bytes over the copy bandwidth (the floor). Then the routed experts (35B-A3B: 256 experts, top 8,
H 2048, I 512, plus the shared expert) at 1..8 tokens: FP8 per pair (4 launches: forced past PAIR_TOKENS) and at the best of a few tiles (weight tiles by
pointers, and by TMA), FP8 sorted (6
launches; as configured, swapped up to 16-row routing blocks, and with 64-row tiles, "sorted 64":
the same bits, checked) and bf16 per pair (2 launches), each against its weight bytes' floor.

  python3 benchmarks/kernels/fp8_kernel_bench.py [M ...]   (default M = 1 8 64; --cold here, with --sweep and with --moe)
  python3 benchmarks/kernels/fp8_kernel_bench.py --moe [T ...]   (default T = 1 2 4 8)
  python3 benchmarks/kernels/fp8_kernel_bench.py --sweep [M ...]
  python3 benchmarks/kernels/fp8_kernel_bench.py --swap [M ...]   (default M = 1 2 4 8 16)
  python3 benchmarks/kernels/fp8_kernel_bench.py --splits [M ...]   (default M = 1 8 64)
  python3 benchmarks/kernels/fp8_kernel_bench.py --prefill [M ...]   (default M = 4096)
  python3 benchmarks/kernels/fp8_kernel_bench.py --moe-prefill [T ...]   (default T = 4096)

``--sweep``: the GEMM alone (activations quantized once, outside the timing) at each decode tile
(BLOCK_N, warps, stages; the same K order, so the same bits: checked against the tree's config)
and at other split counts (another K order: other bits, listed for the record), fastest first.

``--prefill``: the GEMM alone at prefill M: the tree's config, the pointer kernel with its tiles
and with the tiles it had before the TMA kernel, the PREFILL_TILES by TMA (the table's tile also
persistent; same bits, checked), the bf16 GEMM and FlashInfer's block-FP8 GEMM, fastest first
with TFLOP/s. ``--moe-prefill``: the sorted FP8 experts at prefill sizes over routing blocks and
tiles (same bits, checked) beside the bf16 experts.

``--cold`` (after the mode, with the dense table, ``--sweep`` or ``--moe``): each timed call reads
its weights from HBM, as a decode step does. Without it a graph replays one GEMM on one weight
matrix, which then sits in the L2 (50 MB on an H100/H200): the dense FP8 GEMMs at M = 1 took
4.3-6.1 us a call here and 8.86 us a call in the engine's graphed step (benchmarks section 43).
With it the calls rotate through copies of the weights (the routed experts: through token sets
routed to other experts) that together hold ``COLD_L2_FACTOR`` times the L2.

``--splits``: each GEMM a decode step runs at other split counts (another K order: other bits),
the FP8 dense shapes and the small bf16 ones (the router with the shared expert's gate, GDN's
in_proj_ba: 4.7 us a call in the step for a few hundred KB), each split at the best of a few
column tiles, beside the tree's config: whether a split rule with fewer (or more) ranges would
pay at M = 1 without losing at M = 8 and 64. Use it with --cold.

``--swap``: the GEMM alone (and fp8_linear as a layer calls it) with each block's dot swapped
(``SWAP``: the weight rows as the wgmma's M side, 16-row activation tiles) against the tree's
config, at every dense shape, and the routed experts per pair swapped against unswapped; each
swapped output compared bitwise with the tree's (the hardware's side of the swap)."""

from __future__ import annotations

import contextlib
import sys
from functools import partial
from itertools import product

import torch

from bi_core.kernels.fp8 import fp8_config, fp8_linear, quantize_act
from bi_core.kernels.gemm import linear
from bi_core.quant.fp8_numerics import quantize_blocks
from bi_core.tools.bench import measure_bandwidth

SHAPES = [(12352, 2048), (4096, 2048), (2048, 4096), (2048, 2048), (2048, 512)]  # (N, K)
BF16_SMALL = [(257, 2048), (64, 2048)]  # (N, K): the router + shared expert gate, GDN's in_proj_ba
REPS = 20
COLD = "--cold" in sys.argv
COLD_L2_FACTOR = 3  # --cold: the rotated copies hold this many times the L2


def timed_us(fn) -> float:
    """us a call: ``fn`` (a callable, or a list launched in turn: one call each, at least REPS calls
    a graph) captured in a CUDA graph, replayed."""
    fns = fn if isinstance(fn, list) else [fn]
    calls = max(REPS, len(fns))
    fns[0]()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * calls)


def cold_copies(nbytes: int, l2_bytes: int, factor: int = COLD_L2_FACTOR) -> int:
    """How many copies of ``nbytes`` of weights together hold ``factor`` times an L2 of ``l2_bytes``
    (at least 2): calls rotating through them find none of their weights in the L2."""
    return max(2, -(-factor * l2_bytes // max(nbytes, 1)))


def rotations(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """``tensors`` (one call's weights) and, under --cold, copies of them enough to miss the L2."""
    if not COLD:
        return [tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    n = cold_copies(nbytes, torch.cuda.get_device_properties(tensors[0].device).L2_cache_size)
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(n - 1)]


def each(copies: list[tuple], fn, *before, **kw) -> list:
    """``fn(*before, *copy, **kw)`` for every copy (``timed_us`` launches them in turn)."""
    return [partial(fn, *before, *c, **kw) for c in copies]


def dense_cases(ms: list[int], dev: torch.device):
    """(N, K, M, wq, ws, bf16 weight, bf16 rows) for each dense shape and M (weights drawn once a shape)."""
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev) * 0.02
        wq, ws = quantize_blocks(w, (128, 128))
        wb = w.to(torch.bfloat16)
        for m in ms:
            yield n, k, m, wq, ws, wb, torch.randn(m, k, device=dev, dtype=torch.bfloat16)


def sweep(ms: list[int]) -> None:
    from bi_core.kernels.fp8 import fp8_gemm, split_k_for

    dev = torch.device("cuda")
    bw = measure_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s; GEMM alone, us per call"
          f"{', weights from HBM (--cold)' if COLD else ''}")
    for n, k in SHAPES[:3]:
        wq, ws = quantize_blocks(torch.randn(n, k, device=dev) * 0.02, (128, 128))
        copies = rotations(wq, ws)
        split = split_k_for(n, k)
        for m in ms:
            xq, xs = quantize_act(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            base = fp8_config(m, n, k)
            ref = fp8_gemm(xq, xs, wq, ws, config=base)
            rows = []
            for bn in (64, 128) if base["SWAP"] else (16, 32, 64, 128):  # a swapped tile: >= 64 weight rows
                for warps in (4,):
                    for stages in (2, 3, 4):
                        for sp in sorted({split, split * 2}):
                            cfg = {**base, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "SPLIT_K": sp,
                                   "INLINE": False}
                            try:
                                out = fp8_gemm(xq, xs, wq, ws, config=cfg)
                                t = timed_us(each(copies, fp8_gemm, xq, xs, config=cfg))
                            except Exception as e:  # a tile that does not fit: reported, the sweep goes on
                                rows.append((float("inf"), cfg, type(e).__name__))
                                continue
                            same = torch.equal(out, ref)
                            if sp == split and not same:
                                raise SystemExit(f"{n}x{k} M={m} {cfg}: bits differ from the tree's config")
                            rows.append((t, cfg, "same bits" if same else "other K order"))
            rows.sort(key=lambda r: r[0])
            t_base = timed_us(each(copies, fp8_gemm, xq, xs, config=base))
            print(f"{n:>6} x {k:<5} M={m:<3} tree {t_base:6.1f}us (BLOCK_N {base['BLOCK_N']}, {base['num_warps']} warps, "
                  f"{base['num_stages']} stages, split {split}); floor {n * k / bw * 1e6:.1f}us; best:")
            for t, cfg, note in rows[:4]:
                print(f"      {t:6.1f}us  BLOCK_N {cfg['BLOCK_N']:>3} warps {cfg['num_warps']} stages "
                      f"{cfg['num_stages']} split {cfg['SPLIT_K']}  ({note})")


def split_candidates(kind: str, n: int, k: int) -> list[int]:
    """The split counts a GEMM of (N, K) can run: each range a whole number of K blocks (FP8: 128;
    bf16: ``block_k_for``)."""
    from bi_core.kernels import gemm

    blocks = -(-k // (128 if kind == "fp8" else gemm.block_k_for(n, k)))
    return [s for s in (1, 2, 4, 8, 16, 32) if blocks % s == 0]


def split_probe(ms: list[int]) -> None:
    from bi_core.kernels import fp8, gemm

    dev = torch.device("cuda")
    bw = measure_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s; each GEMM alone at every split "
          f"count, us per call{', weights from HBM (--cold)' if COLD else ''}; 'split S: T (BLOCK_N)' is the best "
          f"column tile at S ranges, * the tree's split")
    for kind, shapes in (("fp8", SHAPES), ("bf16", BF16_SMALL)):
        for n, k in shapes:
            if kind == "fp8":
                wq, ws = quantize_blocks(torch.randn(n, k, device=dev) * 0.02, (128, 128))
                copies, tree_split, nbytes = rotations(wq, ws), fp8.split_k_for(n, k), n * k
            else:
                w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
                copies, tree_split, nbytes = rotations(w), gemm.split_k_for(n, k), 2 * n * k
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                if kind == "fp8":
                    xq, xs = quantize_act(x)
                    base = fp8_config(m, n, k)
                    run = partial(each, copies, fp8.fp8_gemm, xq, xs)
                    tiles = (64, 128) if base["SWAP"] else (32, 64, 128)  # a swapped tile: >= 64 weight rows
                else:
                    base = gemm.gemm_config(m, n, k)
                    run = partial(each, copies, linear, x)
                    tiles = (16, 32, 64)
                ref = run(config=base)[0]()
                found = []
                for sp in split_candidates(kind, n, k):
                    best = None
                    for bn in tiles:
                        cfg = {**base, "BLOCK_N": bn, "SPLIT_K": sp, "INLINE": base["INLINE"] and sp == tree_split}
                        try:
                            out = run(config=cfg)[0]()
                            t = timed_us(run(config=cfg))
                        except Exception as e:  # noqa: BLE001 - a tile that does not fit: the sweep goes on
                            print(f"      split {sp} BLOCK_N {bn}: {type(e).__name__}")
                            continue
                        if sp == tree_split and not torch.equal(out, ref):
                            raise SystemExit(f"{kind} {n}x{k} M={m} {cfg}: bits differ from the tree's config")
                        best = min(best or (t, bn), (t, bn))
                    if best:
                        found.append(f"{'*' if sp == tree_split else ''}{sp}: {best[0]:.1f} ({best[1]})")
                t_base = timed_us(run(config=base))
                print(f"{kind:>4} {n:>6} x {k:<5} M={m:<3} tree {t_base:6.1f}us (split {tree_split}, BLOCK_N "
                      f"{base['BLOCK_N']}); floor {nbytes / bw * 1e6:.1f}us; split " + " | ".join(found))


# the tiles that fit (128 x 256 and 64 x 256 lost 2-4x at 12352 x 2048 on 2026-11-29: section 39)
PREFILL_TILES = [(64, 64, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5), (128, 64, 4, 3),
                 (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4)]


def pre_tma_config(m: int, n: int, k: int) -> dict:
    """fp8_config's pointer-kernel tiles at M, as before the TMA kernel (its row bound out of reach)."""
    from bi_core.kernels import fp8

    bound, fp8.TMA_MIN_M = fp8.TMA_MIN_M, 1 << 62
    try:
        return fp8_config(m, n, k)
    finally:
        fp8.TMA_MIN_M = bound


def prefill_sweep(ms: list[int]) -> None:
    """The dense GEMMs at prefill M: the tree's config (TMA tiles from TMA_MIN_M rows), the pointer
    kernel with the same tiles, every PREFILL_TILES tile by TMA (persistent and not), the bf16 GEMM
    and, where installed, FlashInfer's block-FP8 GEMM on the same quantized rows; us a call and
    TFLOP/s. Every tile must give the tree's bits (the same K order), checked."""
    from bi_core.kernels.fp8 import fp8_gemm

    dev = torch.device("cuda")
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        from bi_core.backends.cuda_common.kernel_calls import fi_act_scales
    except ImportError:
        fp8_blockscale_gemm_sm90 = None
    print(f"{torch.cuda.get_device_name()}: GEMM alone (rows quantized once), us a call, TFLOP/s")
    for n, k, m, wq, ws, wb, x in dense_cases(ms, dev):
        xq, xs = quantize_act(x)
        base = fp8_config(m, n, k)
        ref = fp8_gemm(xq, xs, wq, ws, config=base)
        flop = 2 * m * n * k
        rows = [("tree " + " ".join(f"{key}={base[key]}" for key in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages",
                                                                       "SPLIT_K", "TMA") if key in base),
                 timed_us(partial(fp8_gemm, xq, xs, wq, ws, config=base)))]
        pointer = {**base, "TMA": False}
        if not torch.equal(fp8_gemm(xq, xs, wq, ws, config=pointer), ref):
            raise SystemExit(f"{n}x{k} M={m}: the pointer kernel's bits differ from the tree's")
        rows.append(("pointer, same tiles", timed_us(partial(fp8_gemm, xq, xs, wq, ws, config=pointer))))
        before = pre_tma_config(m, n, k)
        rows.append((f"pointer, pre-TMA tiles (BLOCK_N {before['BLOCK_N']})",
                     timed_us(partial(fp8_gemm, xq, xs, wq, ws, config=before))))
        for bm, bn, warps, stages in PREFILL_TILES:  # (persistent programs lost with every tile: section 39)
            cfg = {**base, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "TMA": True,
                   "INLINE": True, "SWAP": False}
            name = f"TMA {bm}x{bn} {warps}w {stages}st"
            try:
                same = torch.equal(fp8_gemm(xq, xs, wq, ws, config=cfg), ref)
                rows.append((name + ("" if same else " (OTHER BITS)"),
                             timed_us(partial(fp8_gemm, xq, xs, wq, ws, config=cfg))))
            except Exception as e:  # a tile that does not fit: reported, the sweep goes on
                rows.append((f"{name}: {type(e).__name__}", float("inf")))
        rows.append(("bf16 linear (table)", timed_us(partial(linear, x, wb))))
        if fp8_blockscale_gemm_sm90 is not None:
            rows.append(("FlashInfer fp8_blockscale_gemm_sm90",
                         timed_us(partial(fp8_blockscale_gemm_sm90, xq, wq, fi_act_scales(xs), ws,
                                          out_dtype=torch.bfloat16))))
        print(f"{n:>6} x {k:<5} M={m}")
        for name, us in sorted(rows, key=lambda r: r[1]):
            print(f"      {us:8.1f}us {flop / us / 1e6:7.0f} TFLOP/s  {name}")


SWAP_TILES = [(bn, warps, stages) for bn in (64, 128) for warps in (4,) for stages in (2, 3, 4)]


def swap_probe(ms: list[int]) -> None:
    from bi_core.kernels.fp8 import fp8_gemm
    from bi_core.kernels.fp8_moe import PAIR_DOWN, PAIR_UP, _fp8_moe_per_pair

    dev = torch.device("cuda")
    bw = measure_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s; us per call; swapped dot vs the tree's")
    differ = 0
    for n, k in SHAPES:
        wq, ws = quantize_blocks(torch.randn(n, k, device=dev) * 0.02, (128, 128))
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * torch.exp2(
                torch.randint(-4, 4, (m, 1), device=dev).float()).to(torch.bfloat16)
            xq, xs = quantize_act(x)
            base = fp8_config(m, n, k)
            ref = fp8_gemm(xq, xs, wq, ws, torch.float32, config=base)
            ref_lin = fp8_linear(x, wq, ws, config=base)
            t_base = timed_us(partial(fp8_gemm, xq, xs, wq, ws, config=base))
            t_lin = timed_us(partial(fp8_linear, x, wq, ws, config=base))
            rows = []
            for bn, warps, stages in SWAP_TILES:
                cfg = {**base, "SWAP": True, "BLOCK_M": 16, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
                       "INLINE": False}
                try:
                    same = torch.equal(fp8_gemm(xq, xs, wq, ws, torch.float32, config=cfg), ref) and \
                        torch.equal(fp8_linear(x, wq, ws, config=cfg), ref_lin)
                    t = timed_us(partial(fp8_gemm, xq, xs, wq, ws, config=cfg))
                    t_l = timed_us(partial(fp8_linear, x, wq, ws, config=cfg))
                except Exception as e:  # reported, the probe goes on
                    rows.append((float("inf"), float("inf"), cfg, type(e).__name__))
                    continue
                differ += not same
                rows.append((t, t_l, cfg, "same bits" if same else "DIFFERENT BITS"))
            rows.sort(key=lambda r: r[0])
            print(f"{n:>6} x {k:<5} M={m:<3} tree GEMM {t_base:6.1f}us, linear {t_lin:6.1f}us (BLOCK_N {base['BLOCK_N']}, "
                  f"split {base['SPLIT_K']}); floor {n * k / bw * 1e6:.1f}us; swapped:")
            for t, t_l, cfg, note in rows[:3]:
                print(f"      GEMM {t:6.1f}us linear {t_l:6.1f}us  BLOCK_N {cfg['BLOCK_N']:>3} warps {cfg['num_warps']} "
                      f"stages {cfg['num_stages']}  ({note})")
            if any(r[3] != "same bits" for r in rows):
                print("      not same bits:", sorted({r[3] for r in rows if r[3] != "same bits"}))
    _, _, w13q, w13s, w2q, w2s = expert_weights(dev)
    for t in (1, 2):
        x, ids, wts, shared = routed(t, dev)
        args = (x, wts, ids, w13q, w13s, w2q, w2s, shared)
        ref = _fp8_moe_per_pair(*args)
        t_ref = timed_us(partial(_fp8_moe_per_pair, *args))
        rows = []
        for bn_up, bn_down in ((64, 64), (64, 128), (128, 128)):
            for stages in (2, 3, 4):
                up = {**PAIR_UP, "BLOCK_N": bn_up, "num_stages": stages, "SWAP": True}
                down = {**PAIR_DOWN, "BLOCK_N": bn_down, "num_stages": stages, "SWAP": True}
                run = partial(_fp8_moe_per_pair, *args, up, down)
                same = torch.equal(run(), ref)
                differ += not same
                rows.append((timed_us(run), bn_up, bn_down, stages, "same bits" if same else "DIFFERENT BITS"))
        rows.sort()
        print(f"experts per pair, {t} token(s): tree {t_ref:.1f}us ({PAIR_UP['BLOCK_N']}/{PAIR_DOWN['BLOCK_N']}); "
              f"swapped best: " + "; ".join(f"{r[0]:.1f}us at up {r[1]} down {r[2]} stages {r[3]} ({r[4]})" for r in rows[:3]))
    print(f"swapped outputs with other bits than the tree's: {differ}")


EXPERTS, TOP, HIDDEN, INTER = 256, 8, 2048, 512  # 35B-A3B's routed experts (plus the shared one, last)


def expert_weights(dev: torch.device):
    """bf16 w13 [E+1, 2I, H] and w2 [E+1, H, I], and their block-FP8 copies with scales."""
    w13 = torch.randn(EXPERTS + 1, 2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS + 1, HIDDEN, INTER, device=dev, dtype=torch.bfloat16) * 0.02
    q13 = [quantize_blocks(w13[j].float(), (128, 128)) for j in range(EXPERTS + 1)]
    q2 = [quantize_blocks(w2[j].float(), (128, 128)) for j in range(EXPERTS + 1)]
    return (w13, w2, torch.stack([q[0] for q in q13]), torch.stack([q[1] for q in q13]),
            torch.stack([q[0] for q in q2]), torch.stack([q[1] for q in q2]))


def routed(t: int, dev: torch.device):
    """T tokens' rows, top-k ids (distinct per token), weights and shared-expert logits."""
    x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, device=dev)[:TOP] for _ in range(t)])  # int64, as torch.topk's
    return x, ids, torch.rand(t, TOP, device=dev).softmax(-1), torch.randn(t, device=dev, dtype=torch.bfloat16)


def routed_sets(args: tuple, per_call: int) -> list[tuple]:
    """``args`` (``fp8_fused_moe``'s), and under --cold other token sets of as many tokens routed to
    other experts, until the sets' experts hold COLD_L2_FACTOR times the L2 (``per_call`` bytes a
    set): timed in turn, a call finds its experts' weights in HBM. Checks run on ``args``."""
    if not COLD:
        return [args]
    x = args[0]
    sets = [args]
    for _ in range(cold_copies(per_call, torch.cuda.get_device_properties(x.device).L2_cache_size) - 1):
        x2, ids, wts, shared = routed(x.shape[0], x.device)
        sets.append((x2, wts, ids, *args[3:7], shared))
    return sets


@contextlib.contextmanager
def routing_block(rows: int):
    """moe.align's routing block forced to ``rows`` (its rule: moe.block_m_for of the pairs an expert,
    up to fp8_moe.ROUTE_BLOCK_MAX for the FP8 experts)."""
    from bi_core.kernels import fp8_moe, moe

    rule, cap = moe.block_m_for, fp8_moe.ROUTE_BLOCK_MAX
    moe.block_m_for, fp8_moe.ROUTE_BLOCK_MAX = (lambda m: rows), rows
    try:
        yield
    finally:
        moe.block_m_for, fp8_moe.ROUTE_BLOCK_MAX = rule, cap


def moe_prefill(ts: list[int]) -> None:
    """The sorted FP8 experts at prefill sizes: the tree's grouped tiles and others (the same K
    order, so the same bits: checked), against the bf16 experts; us a call and TFLOP/s."""
    from bi_core.kernels.fp8_moe import ROUTE_BLOCK_MAX, fp8_fused_moe, grouped_config
    from bi_core.kernels.moe import align, fused_moe

    dev = torch.device("cuda")
    w13, w2, w13q, w13s, w2q, w2s = expert_weights(dev)
    print(f"{torch.cuda.get_device_name()}: routed experts at prefill sizes (sorted), us a call, TFLOP/s")
    for t in ts:
        x, ids, wts, shared = routed(t, dev)
        args = (x, wts, ids, w13q, w13s, w2q, w2s, shared)
        route_m = align(ids, EXPERTS + 1, shared=True, max_block_m=ROUTE_BLOCK_MAX).block_m
        ref = fp8_fused_moe(*args)
        flop = 2 * t * (TOP + 1) * 3 * INTER * HIDDEN
        bf16 = partial(fused_moe, x, wts, ids, w13, w2, shared)
        rows = [(f"fp8 tree (routing block {route_m}: {grouped_config(route_m)})", timed_us(partial(fp8_fused_moe, *args))),
                (f"bf16 experts (routing block {align(ids, EXPERTS + 1, shared=True).block_m})", timed_us(bf16))]
        bf16_ref = bf16()
        with routing_block(64):  # the bf16 experts in the FP8 experts' routing blocks (same bits: moe.py's docstring)
            same = torch.equal(bf16(), bf16_ref)
            rows.append(("bf16 experts, routing 64" + ("" if same else " (OTHER BITS)"), timed_us(bf16)))
        # (gate and up in one K loop on unswapped tiles: 3.5% faster at T = 4096, slower at 16384; section 39)
        # The routing block too: at about 128 pairs an expert, 128-row blocks pad about half the experts
        # to 256 rows, 64-row blocks waste less on smaller tiles. A pair's row is the same either way.
        # (BLOCK_N 256 lost 1.9-7x at both sizes; section 39.) TMA: the weight tiles by TMA (branch wip/fp8-moe-tma).
        for route, bn, warps, stages, tma in product((64, 128), (64, 128), (4, 8), (3, 4), (False, True)):
            cfg = {"BLOCK_M": max(64, route), "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "SWAP": False,
                   "TMA": tma}
            name = f"fp8 routing {route}, {cfg['BLOCK_M']}x{bn} {warps}w {stages}st{' TMA' if tma else ''}"
            try:
                with routing_block(route):
                    same = torch.equal(fp8_fused_moe(*args, config=cfg), ref)
                    rows.append((name + ("" if same else " (OTHER BITS)"),
                                 timed_us(partial(fp8_fused_moe, *args, config=cfg))))
            except Exception as e:  # a tile that does not fit: reported, the sweep goes on
                rows.append((f"{name}: {type(e).__name__}", float("inf")))
        print(f"T={t}")
        for name, us in sorted(rows, key=lambda r: r[1]):
            print(f"      {us:8.1f}us {flop / us / 1e6:7.0f} TFLOP/s  {name}")


def moe(ts: list[int]) -> None:
    """Routed experts per pair and sorted (FP8), per pair (bf16), same routing, same tokens."""
    from bi_core.kernels.fp8_moe import _fp8_moe_per_pair, fp8_fused_moe
    from bi_core.kernels.moe import fused_moe

    dev = torch.device("cuda")
    bw = measure_bandwidth(dev)
    w13, w2, w13q, w13s, w2q, w2s = expert_weights(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s; routed experts, us per call"
          f"{', each call routed to other experts (--cold)' if COLD else ''}")
    print(f"{'T':>3} {'experts':>7} {'fp8 per pair':>12} {'fp8 sorted':>11} {'sorted 64':>11} {'bf16 per pair':>13} "
          f"{'fp8 floor':>9} {'bf16 floor':>10}  per pair == sorted; best per-pair tile (columns / warps, stages)")
    for t in ts:
        x, ids, wts, shared = routed(t, dev)
        args = (x, wts, ids, w13q, w13s, w2q, w2s, shared)
        sets = routed_sets(args, (int(torch.unique(ids).numel()) + 1) * 3 * INTER * HIDDEN)
        same = torch.equal(fp8_fused_moe(*args, per_pair=True), fp8_fused_moe(*args, per_pair=False))
        t_pair = timed_us([partial(fp8_fused_moe, *a, per_pair=True) for a in sets])
        tiles = {False: [], True: []}
        # swapped dots: >= 64 weight rows a tile; (columns, warps) of the gate/up and the down kernels;
        # the weight tiles by pointers or by TMA (the same bits: checked)
        for (bn_up, w_up), (bn_down, w_down) in product(((64, 4), (128, 4)), ((64, 4), (128, 4), (256, 4))):
            for stages, tma in product((3, 4, 6), (False, True)):
                up = {"BLOCK_N": bn_up, "num_warps": w_up, "num_stages": stages, "SWAP": True, "TMA": tma}
                down = {"BLOCK_N": bn_down, "num_warps": w_down, "num_stages": stages, "SWAP": True, "TMA": tma}
                run = partial(_fp8_moe_per_pair, *args[:7], args[7], up, down)
                try:
                    same = torch.equal(run(), fp8_fused_moe(*args, per_pair=False))
                    run = [partial(_fp8_moe_per_pair, *a[:7], a[7], up, down) for a in sets]
                except Exception as e:  # a tile that does not fit: reported, the sweep goes on
                    print(f"      {up} {down}: {type(e).__name__}")
                    continue
                if not same:
                    raise SystemExit(f"per-pair tiles {up} {down}: bits differ from the sorted path")
                tiles[tma].append((timed_us(run), f"up {bn_up}/{w_up}w", f"down {bn_down}/{w_down}w",
                                   f"{stages} stages"))
        best, best_tma = min(tiles[False]), min(tiles[True])
        t_sorted = timed_us([partial(fp8_fused_moe, *a, per_pair=False) for a in sets])
        sorted_tma = partial(fp8_fused_moe, *args, per_pair=False, config={"TMA": True})
        if not torch.equal(sorted_tma(), fp8_fused_moe(*args, per_pair=False)):
            raise SystemExit("sorted path: TMA weight tiles give other bits")
        t_sorted_tma = timed_us([partial(fp8_fused_moe, *a, per_pair=False, config={"TMA": True}) for a in sets])
        unswapped = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "SWAP": False}
        if not torch.equal(fp8_fused_moe(*args, config=unswapped), fp8_fused_moe(*args, per_pair=False)):
            raise SystemExit("sorted path: swapped bits differ from 64-row tiles")
        t_sorted64 = timed_us([partial(fp8_fused_moe, *a, config=unswapped) for a in sets])
        t_bf16 = timed_us([partial(fused_moe, a[0], a[1], a[2], w13, w2, a[7]) for a in sets])
        n_exp = int(torch.unique(ids).numel()) + 1
        fp8_bytes = n_exp * 3 * INTER * HIDDEN
        print(f"{t:>3} {n_exp:>7} {t_pair:>10.1f}us {t_sorted:>9.1f}us {t_sorted64:>9.1f}us {t_bf16:>11.1f}us "
              f"{fp8_bytes / bw * 1e6:>7.1f}us {2 * fp8_bytes / bw * 1e6:>8.1f}us  {same}; "
              f"{best[0]:.1f}us at {best[1:]}; TMA: {best_tma[0]:.1f}us at {best_tma[1:]}; sorted TMA {t_sorted_tma:.1f}us")
        by_tile = {row[1:]: row[0] for row in tiles[False]}
        for us, *tile in sorted(tiles[True])[:6]:  # the fastest TMA tiles beside the same tiles by pointers
            print(f"      TMA {us:6.1f}us  pointers {by_tile.get(tuple(tile), float('nan')):6.1f}us  {tile}")


def main() -> None:
    argv = [a for a in sys.argv[1:] if a != "--cold"]  # (read as COLD)
    if argv[:1] == ["--sweep"]:
        sweep([int(a) for a in argv[1:]] or [1, 8, 64])
        return
    if argv[:1] == ["--splits"]:
        split_probe([int(a) for a in argv[1:]] or [1, 8, 64])
        return
    if argv[:1] == ["--swap"]:
        swap_probe([int(a) for a in argv[1:]] or [1, 2, 4, 8, 16])
        return
    if argv[:1] == ["--prefill"]:
        prefill_sweep([int(a) for a in argv[1:]] or [4096])
        return
    if argv[:1] == ["--moe-prefill"]:
        moe_prefill([int(a) for a in argv[1:]] or [4096])
        return
    if argv[:1] == ["--moe"]:
        moe([int(a) for a in argv[1:]] or [1, 2, 4, 8])
        return
    ms = [int(a) for a in argv] or [1, 8, 64]
    dev = torch.device("cuda")
    bw = measure_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s"
          f"{'; weights from HBM (--cold)' if COLD else ''}")
    print(f"{'N x K':>12} {'M':>4} {'fp8 linear':>11} {'quant':>7} {'bf16':>7} {'fp8 floor':>9} {'bf16 floor':>10}  config")
    for n, k, m, wq, ws, wb, x in dense_cases(ms, dev):
        cfg = fp8_config(m, n, k)
        t_set = timed_us(each(rotations(wq, ws), fp8_linear, x, config=cfg))
        t_q = timed_us(partial(quantize_act, x))
        t_b = timed_us(each(rotations(wb), linear, x))
        print(f"{n:>6} x {k:<5} {m:>4} {t_set:>9.1f}us {t_q:>5.1f}us {t_b:>5.1f}us "
              f"{n * k / bw * 1e6:>7.1f}us {2 * n * k / bw * 1e6:>8.1f}us  {cfg}")


if __name__ == "__main__":
    main()
