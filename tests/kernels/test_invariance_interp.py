"""Bitwise batch invariance of the invariant backend's Triton kernels, on the CPU through Triton's
interpreter (or on the GPU when there is one): a row's outputs alone, inside batches of other
sizes and with the batch permuted are ``torch.equal``; each property has a negative control, the
same check on a variant whose arithmetic depends on the batch, which must find a difference.

Two choices make these checks mean something under the interpreter:

- ``ordered_dot`` (conftest.py): numpy's matmul rounds an element by its place in the tile, an
  artifact no GPU MMA has; with it a difference can only come from the kernel's own arithmetic.
- Each property is checked in bf16 (the GPU's dtype) and in fp32. A bf16 output hides most
  reduction-order changes: the GEMM test's 2,800 outputs (70 x 40, K = 1,024) are the same bf16
  bits with 4, 2 or 1 K splits, while in fp32 1,465 and 1,756 of them differ (measured here). So
  the fp32 runs are the ones with teeth, and the negative controls run in fp32.

Every input is random from a seed of its own per test; fresh outputs are NaN (``poisoned_empty``),
so unwritten elements never compare equal."""

from __future__ import annotations

import zlib

import pytest
import torch

pytestmark = pytest.mark.usefixtures("ordered_dot", "poisoned_empty")

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """A seed of the test's own (its node id's CRC), so no two tests draw the same inputs."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


def _tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def row_mismatches(fn, num_rows: int, sizes, device, variants=()) -> list[str]:
    """``fn(rows)`` -> tensor(s) with one row per entry of ``rows`` (indices into the test's
    inputs). Compares the first m rows at each size, a permuted batch and each of ``variants``
    (other launch shapes of the whole batch) with the whole batch, bitwise; returns what
    differed (empty: invariant)."""
    every = torch.arange(num_rows, device=device)
    ref = _tuple(fn(every))
    bad = []
    for j, variant in enumerate(variants):
        got = _tuple(variant(every))
        bad += [f"output {i}, variant {j}" for i, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b)]
    for m in sizes:
        got = _tuple(fn(every[:m]))
        bad += [f"output {i}, first {m} rows" for i, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b[:m])]
    perm = torch.randperm(num_rows, device=device)
    got = _tuple(fn(perm))
    bad += [f"output {i}, permuted" for i, (a, b) in enumerate(zip(got, ref)) if not torch.equal(a, b[perm])]
    return bad


def test_harness_negative_control(device):
    """The harness itself sees a row that depends on the other rows (a batch-wide reduction)."""
    x = torch.randn(40, 64, device=device)
    assert row_mismatches(lambda rows: x[rows] - x[rows].sum(0) / 7, 40, (1, 7, 16), device)


# ----------------------------------------------------------------------------------- GEMM

GEMM_N, GEMM_K = 40, 1024  # SPLIT_K 4 from (N, K): four K ranges of four BLOCK_K steps
GEMM_ROWS, GEMM_SIZES = 70, (1,)  # alone: 16 x 16 tiles; the whole batch: 64 x 64 tiles (the mid tiles)


def _gemm_inputs(device, dtype):
    w = (torch.randn(GEMM_N, GEMM_K, device=device) / GEMM_K**0.5).to(dtype)
    w2 = (torch.randn(2 * GEMM_N, GEMM_K, device=device) / GEMM_K**0.5).to(dtype)  # [gate; up]
    x = torch.randn(GEMM_ROWS, GEMM_K, device=device).to(dtype)
    return x, w, w2


def _poisoned(rows, cols, like):
    return torch.full((rows, cols), float("nan"), dtype=like.dtype, device=like.device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_rows_invariant_split_and_inline(device, dtype):
    """The split-K GEMM (plain and with the SiLU-and-mul epilogue): a row's bits are the same
    alone (M=1: split programs, 16-row tiles), in a batch of 70 rows (64-row tiles; the fix-up's
    workspace is laid out by M), permuted, and through the INLINE path (one program adds its
    tile's splits in split order) that large batches take."""
    from bi_core.kernels.gemm import gemm_config, linear

    x, w, w2 = _gemm_inputs(device, dtype)
    assert gemm_config(1, GEMM_N, GEMM_K)["SPLIT_K"] == 4
    assert gemm_config(16384, 2048, 4096)["INLINE"] and not gemm_config(1, 2048, 4096)["INLINE"]

    def run(rows, inline=None):
        a = x[rows]
        m = a.shape[0]
        cfg = None if inline is None else {**gemm_config(m, GEMM_N, GEMM_K, dtype), "INLINE": inline}
        out = linear(a, w, out=_poisoned(m, GEMM_N, a), config=cfg)
        return out, linear(a, w2, silu_mul=True, config=cfg)

    assert not gemm_config(x.shape[0], GEMM_N, GEMM_K)["INLINE"]  # the whole batch: split programs + fix-up
    assert row_mismatches(run, x.shape[0], GEMM_SIZES, device, [lambda rows: run(rows, inline=True)]) == []


def test_gemm_negative_control(device):
    """A split count that follows M (as an M-keyed heuristic would: 4 splits up to 16 rows, 2
    beyond) changes the K order of every row of a larger batch; the check must see it."""
    from bi_core.kernels.gemm import gemm_config, linear

    x, w, _ = _gemm_inputs(device, torch.float32)

    def with_splits(a, split):
        return linear(a, w, config={**gemm_config(a.shape[0], GEMM_N, GEMM_K, a.dtype), "SPLIT_K": split})

    assert not torch.equal(with_splits(x, 4), with_splits(x, 2))  # the two K orders differ here
    by_batch = lambda rows: with_splits(x[rows], 4 if rows.shape[0] <= 16 else 2)
    assert row_mismatches(by_batch, x.shape[0], GEMM_SIZES, device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_tma_rows_equal_the_decode_rows(device, dtype, monkeypatch):
    """Prefill-sized M loads tiles by TMA (``_gemm_tma_kernel``, 128-row tiles, splits summed in
    the program): each row (plain and SiLU-and-mul) is bitwise the row computed alone (M=1: split
    programs and the ordered fix-up) and the pointer kernel's with the same tiles. Negative control:
    the TMA kernel with 2 K splits instead of 4 differs (the comparison sees a K-order change)."""
    from bi_core.kernels import gemm
    from bi_core.kernels.gemm import TMA_MIN_M, gemm_config, linear

    monkeypatch.setattr(gemm, "TMA_MIN_N", GEMM_N)  # the table's TMA tiles at this test's narrow N
    w = (torch.randn(GEMM_N, GEMM_K, device=device) / GEMM_K**0.5).to(dtype)
    w2 = (torch.randn(2 * GEMM_N, GEMM_K, device=device) / GEMM_K**0.5).to(dtype)
    x = torch.randn(TMA_MIN_M + 9, GEMM_K, device=device).to(dtype)
    cfg = {**gemm_config(x.shape[0], GEMM_N, GEMM_K, torch.bfloat16), "TMA": True}  # fp32 too, to have teeth
    assert cfg["SPLIT_K"] == 4 and cfg["INLINE"] and cfg["BLOCK_M"] == 128 and cfg["PERSISTENT"]
    full, full2 = linear(x, w, config=cfg), linear(x, w2, silu_mul=True, config=cfg)
    pointer = {**cfg, "TMA": False}
    assert torch.equal(full, linear(x, w, config=pointer))
    assert torch.equal(full2, linear(x, w2, silu_mul=True, config=pointer))
    for i in (0, 1, 127, 128, x.shape[0] - 1):
        assert torch.equal(linear(x[i:i + 1], w), full[i:i + 1]), f"row {i}"
        assert torch.equal(linear(x[i:i + 1], w2, silu_mul=True), full2[i:i + 1]), f"row {i} (SiLU-and-mul)"
    if dtype == torch.float32:
        assert not torch.equal(linear(x, w, config={**cfg, "SPLIT_K": 2}), full)


# ----------------------------------------------------------------------------------- norms

NORM_ROWS, NORM_DIM, NORM_HEADS, HEAD_DIM = 12, 96, 8, 16  # 96 of a 128 block; 8 heads: 8 per program


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_rows_invariant(device, dtype):
    """RMSNorm, the fused add + RMSNorm (both outputs) and the gated norm, over whole rows and per
    head of strided rows (8 heads a program, into a poisoned strided output)."""
    from bi_core.kernels.norm import gated_rms_norm, rms_norm

    x, r, g = (torch.randn(NORM_ROWS, NORM_DIM, device=device).to(dtype) for _ in range(3))
    w = (0.1 * torch.randn(NORM_DIM, device=device)).to(dtype)
    proj = torch.randn(NORM_ROWS, 3 * NORM_HEADS * HEAD_DIM, device=device).to(dtype)
    wh = (1 + 0.1 * torch.randn(HEAD_DIM, device=device)).to(dtype)
    width = NORM_HEADS * HEAD_DIM

    def run(rows):
        p = proj[rows]
        out = torch.full((rows.shape[0], 2 * width), float("nan"), dtype=dtype, device=device)[:, :width]
        per_head = gated_rms_norm(p[:, :width], p[:, width:2 * width], wh, 1e-6, head_dim=HEAD_DIM, out=out)
        return (rms_norm(x[rows], w, 1e-6), *rms_norm(x[rows], w, 1e-6, residual=r[rows]),
                gated_rms_norm(x[rows], g[rows], w + 1, 1e-6), per_head)

    assert row_mismatches(run, NORM_ROWS, (1, 5), device) == []


def test_norms_negative_control(device):
    """A norm whose sum of squares is blocked by the batch size (two halves past 8 rows, as
    rows-per-program and block choices keyed on the token count do, vLLM #48271): the check sees it."""
    x = torch.randn(NORM_ROWS, NORM_DIM, device=device)
    w = 0.1 * torch.randn(NORM_DIM, device=device)

    def norm(a, halves):
        sq = a * a
        ss = sq[:, :48].sum(-1) + sq[:, 48:].sum(-1) if halves else sq.sum(-1)
        return a * torch.rsqrt(ss / NORM_DIM + 1e-6)[:, None] * (1 + w)

    assert not torch.equal(norm(x, False), norm(x, True))
    assert row_mismatches(lambda rows: norm(x[rows], rows.shape[0] > 8), NORM_ROWS, (1, 5), device)


# ------------------------------------------------------------------------------ top-k + MoE

MOE_E, MOE_K, MOE_H, MOE_I, MOE_TOKENS = 8, 4, 64, 32, 30
MOE_SIZES = (1, 8, 12)  # per pair (PAIR_TOKENS = 8), per pair, sorted with 16-row blocks; all 30: 32-row blocks


def _moe_inputs(device, dtype):
    x = torch.randn(MOE_TOKENS, MOE_H, device=device).to(dtype)
    router = (torch.randn(MOE_E + 1, MOE_H, device=device) / MOE_H**0.5).to(dtype)
    w13 = (torch.randn(MOE_E + 1, 2 * MOE_I, MOE_H, device=device) / MOE_H**0.5).to(dtype)  # + the shared expert
    w2 = (torch.randn(MOE_E + 1, MOE_H, MOE_I, device=device) / MOE_I**0.5).to(dtype)
    return x, x.float() @ router.float().T, w13, w2  # router logits in fp32 via torch: top-k and MoE only


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_and_moe_rows_invariant_sorted_equals_per_pair(device, dtype):
    """Routing (softmax top-k) and the fused MoE with a shared expert: a token alone and in 8
    tokens runs the per-pair path (no routing sort, combine fused into the down GEMM), in 12 and
    30 tokens the sorted path (16- and 32-row expert blocks): the same bits, also permuted. So
    every row of the per-pair path is compared, bitwise, with the sorted path's (the existing
    ``fused_moe == _moe_per_pair`` check in test_kernels.py compares the per-pair path with
    itself: fused_moe takes that path up to PAIR_TOKENS tokens, the only sizes it tries)."""
    from bi_core.kernels.moe import PAIR_TOKENS, align, fused_moe
    from bi_core.kernels.topk import softmax_topk

    x, logits, w13, w2 = _moe_inputs(device, dtype)
    assert MOE_SIZES[1] == PAIR_TOKENS < MOE_SIZES[2]
    assert [align(torch.zeros(t, MOE_K, dtype=torch.int64, device=device), MOE_E + 1, True).block_m
            for t in (MOE_SIZES[2], MOE_TOKENS)] == [16, 32]

    def run(rows):
        wts, ids = softmax_topk(logits[rows, :MOE_E], MOE_K)  # a strided view, as the model passes it
        return fused_moe(x[rows], wts, ids, w13, w2, logits[rows, MOE_E]), wts, ids

    assert row_mismatches(run, MOE_TOKENS, MOE_SIZES, device) == []


def test_moe_negative_control(device):
    """The same experts and weights combined in another slot order (reversed) once the batch
    passes PAIR_TOKENS, as a sorted path adding the k outputs in arrival order would: fp32
    sums of four terms in two orders, which the check must see."""
    from bi_core.kernels.moe import PAIR_TOKENS, fused_moe
    from bi_core.kernels.topk import softmax_topk

    x, logits, w13, w2 = _moe_inputs(device, torch.float32)

    def run(rows, reverse):
        wts, ids = softmax_topk(logits[rows, :MOE_E], MOE_K)
        if reverse:
            wts, ids = wts.flip(1), ids.flip(1)
        return fused_moe(x[rows], wts, ids, w13, w2, logits[rows, MOE_E])

    every = torch.arange(MOE_TOKENS, device=device)
    assert not torch.equal(run(every, False), run(every, True))
    assert row_mismatches(lambda rows: run(rows, rows.shape[0] > PAIR_TOKENS), MOE_TOKENS, (1,), device)


# ------------------------------------------------------------------------------ attention

ATT_HQ, ATT_HKV, ATT_D, PAGE = 4, 2, 32, 16
ATT_WIDTH = 2 * ATT_HQ * ATT_D + 2 * ATT_HKV * ATT_D  # [q | gate] per query head, then k, v


def _needle_pos() -> int:
    """The needle token's position: its context spans three KV_SPLIT-key chunks."""
    from bi_core.kernels.attention import KV_SPLIT

    return 2 * KV_SPLIT + 8


def _attention_impl(device, dtype, kv="auto", kv_scales=False):
    from bi_core.backends.cuda_common.attention import TritonPagedAttentionImpl
    from bi_core.ops.attention import AttentionSpec

    spec = AttentionSpec(dtype=dtype, device=device, num_heads=ATT_HQ, num_kv_heads=ATT_HKV, head_dim=ATT_D,
                         scale=ATT_D**-0.5, rotary_dim=8, rope_theta=1e4, norm_eps=1e-6, kv_cache_dtype=kv,
                         kv_scales=kv_scales)
    norms = [(0.1 * torch.randn(ATT_D, device=device)).to(dtype) for _ in range(2)]
    return TritonPagedAttentionImpl(spec), norms


def _att_seq(q_len, past, recurrent, device, dtype):
    """(query tokens, past length, recurrent, past keys, past values, new qkv rows)."""
    kv = [torch.randn(past, ATT_HKV, ATT_D, device=device).to(dtype) for _ in range(2)]
    return (q_len, past, recurrent, *kv, torch.randn(q_len, ATT_WIDTH, device=device).to(dtype))


def _attend(impl, norms, seqs, splits=None, kv_scales=None):
    """Lays ``seqs`` out in a fresh paged cache (their pages in list order, a hole after each,
    every other slot NaN), runs one step and returns (each sequence's output rows, the caches,
    the block tables). ``splits`` overrides the plan's programs per (sequence, KV head), a count
    the plan derives from the batch and which must change no bit. ``kv_scales``: an FP8 cache's
    (k_scale, v_scale), for the past keys and values and the step."""
    import attrs

    from bi_core.backends.reference.attention import _bytes, to_cache
    from bi_core.ops.attention import kv_cache_torch_dtype
    from bi_core.runtime.batch import build_context

    device, dtype = norms[0].device, norms[0].dtype
    kv_dtype = kv_cache_torch_dtype(impl.spec.kv_cache_dtype, dtype)
    blocks, nxt = [], 0
    for q, p, *_ in seqs:
        n = -(-(q + p) // PAGE)
        blocks.append(list(range(nxt, nxt + n)))
        nxt += n + 1
    _, ctx = build_context([[0] * s[0] for s in seqs], [s[1] for s in seqs], blocks, list(range(len(seqs))),
                           [s[2] for s in seqs], block_size=PAGE, device=device)
    kc = torch.full((nxt, PAGE, ATT_HKV, ATT_D), float("nan"), device=device).to(kv_dtype)
    vc = kc.clone()
    for (_, past, _, k, v, _), blk in zip(seqs, blocks):
        slots = torch.tensor([blk[i // PAGE] * PAGE + i % PAGE for i in range(past)], device=device, dtype=torch.long)
        for cache, x, scale in ((kc, k, (kv_scales or (1.0, 1.0))[0]), (vc, v, (kv_scales or (1.0, 1.0))[1])):
            _bytes(cache).view(-1, ATT_HKV, ATT_D)[slots] = _bytes(to_cache(x, cache, scale))  # FP8: as bytes
    if splits is not None:
        plan, key = impl.prepare(ctx), ("attn_plan", impl.tile_tokens)
        assert ctx.op_plans[key] is plan
        ctx.op_plans[key] = attrs.evolve(plan, splits=splits)
    out = impl.forward(torch.cat([s[5] for s in seqs]), *norms, kc, vc, ctx,
                       **({} if kv_scales is None else {"kv_scales": kv_scales}))
    return list(out.split([s[0] for s in seqs])), kc, vc, blocks


def _needle_and_others(device, dtype, kv="auto"):
    """A needle token at ``_needle_pos()`` (three KV_SPLIT-key chunks) computed three ways on the
    same keys, and other sequences to batch it with: decode rows, a 3-token verify row, prefill chunks."""
    from bi_core.kernels.attention import KV_SPLIT

    impl, norms = _attention_impl(device, dtype, kv)
    verify = _att_seq(5, _needle_pos() - 4, True, device, dtype)
    return impl, norms, verify, [_att_seq(1, 40, True, device, dtype),
                                 _att_seq(3, KV_SPLIT + 14, True, device, dtype),
                                 _att_seq(12, 0, False, device, dtype), _att_seq(5, 18, False, device, dtype)]


def _written_kv(kc, vc, blk, n):
    """The first ``n`` positions' keys and values of the sequence on pages ``blk`` (an FP8 cache's
    as float32: exact)."""
    from bi_core.backends.reference.attention import _bytes

    slots = torch.tensor([blk[i // PAGE] * PAGE + i % PAGE for i in range(n)], device=kc.device)
    read = lambda t: _bytes(t).view(-1, ATT_HKV, ATT_D)[slots].view(t.dtype)
    return tuple(x.float() if x.element_size() == 1 else x for x in (read(kc), read(vc)))


def _needle_alone(impl, norms, verify):
    """The needle's keys are what the verify step writes at the 4 positions before it: (needle
    sequence, verify rows)."""
    (rows_v,), kc, vc, (blk,) = _attend(impl, norms, [verify], splits=2)
    needle = (1, _needle_pos(), True, *_written_kv(kc, vc, blk, _needle_pos()), verify[5][4:])
    return needle, rows_v


def _check_batched_and_permuted(impl, norms, seq, alone, others, seed, splits):
    """``seq`` at a random place among ``others`` gives ``alone`` (programs per KV head
    ``splits[0]``), and the batch permuted gives every sequence its bits (``splits[1]``)."""
    import random

    at = random.Random(seed).randrange(len(others) + 1)
    batch = others[:at] + [seq] + others[at:]
    rows, *_ = _attend(impl, norms, batch, splits=splits[0])
    assert torch.equal(rows[at], alone), at
    order = list(range(len(batch)))
    random.Random(seed + 1).shuffle(order)
    permuted, *_ = _attend(impl, norms, [batch[i] for i in order], splits=splits[1])
    assert all(torch.equal(permuted[j], rows[i]) for j, i in enumerate(order))


@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, "auto"), (torch.float32, "auto"), (torch.float32, "fp8_e4m3"),
                                      (torch.bfloat16, "fp8_e4m3")])
def test_attention_rows_invariant_across_batches_and_forms(device, dtype, kv, seed):
    """The gated paged attention (q/k norm, RoPE, KV write, fixed KV_SPLIT-key chunks, output gate):
    a decode row at ``_needle_pos()`` (three chunks) gives the same bits alone (the plan's programs
    per KV head), as the last row of a 5-token verify row (decode form, 8 query tokens a program), and at a random
    place in a batch with decode rows at other lengths, a verify row and prompt chunks (3
    programs per KV head, a chunk each); the batch permuted gives every sequence its bits with 2
    programs per KV head (one folds two chunks in series). The plan derives its program count
    from the batch; overriding it keeps the interpreter quick, and any count must give the same bits.
    With an FP8 cache (e4m3 at scale 1) too."""

    from bi_core.kernels.attention import KV_SPLIT

    impl, norms, verify, others = _needle_and_others(device, dtype, kv)
    needle, rows_v = _needle_alone(impl, norms, verify)
    (alone,), *_ = _attend(impl, norms, [needle])
    assert -(-(_needle_pos() + 1) // KV_SPLIT) == 3
    assert torch.equal(rows_v[4:], alone)
    _check_batched_and_permuted(impl, norms, needle, alone, others, seed, splits=(3, 2))


def test_attention_negative_control(device, monkeypatch):
    """A KV chunk size that follows the batch (FlashInfer's default decode split does, by batch
    size): the needle with chunks of half the size beside other sequences is not the needle alone
    with KV_SPLIT-key chunks, and the check sees it."""
    from bi_core.kernels import attention

    impl, norms, verify, others = _needle_and_others(device, torch.float32)
    needle, _ = _needle_alone(impl, norms, verify)
    (alone,), *_ = _attend(impl, norms, [needle], splits=2)
    monkeypatch.setattr(attention, "KV_SPLIT", attention.KV_SPLIT // 2)
    rows, *_ = _attend(impl, norms, [needle] + others, splits=2)
    assert not torch.equal(rows[0], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_cache_written_and_read_as_the_reference(device, dtype, monkeypatch):
    """An FP8 KV cache (``cache.kv_cache_dtype: fp8``, e4m3 at scale 1): the fused kernel writes
    each key and value as the reference rounds it (clamped to +-448, nearest e4m3, ties to even;
    some values here are past 448), bitwise; decode, verify and prompt rows over it match the
    reference attention on the same cache (the reference reads the cache's exact values); and
    the cache's format shows in the output (the same step over a cache in the model's dtype
    differs), so the invariance tests' FP8 cases do run the FP8 path. A bf16 model's decode rows
    run their dots in float16 (``FP8_KV_F16``): also within the reference's reach, and not the
    bf16 dots' bits (negative control: the switch is live)."""
    from bi_core.backends.reference.attention import ReferenceAttentionImpl, to_cache
    from bi_core.kernels import attention
    from bi_core.runtime.batch import build_context

    impl, norms = _attention_impl(device, dtype, "fp8_e4m3")
    plain, _ = _attention_impl(device, dtype)
    seqs = [_att_seq(1, 300, True, device, dtype), _att_seq(3, 40, True, device, dtype),
            _att_seq(20, 0, False, device, dtype)]
    seqs[2][5][:, -ATT_HKV * ATT_D:] *= 300  # values past e4m3's 448 (clamped when written)
    rows, kc, vc, blocks = _attend(impl, norms, seqs)
    plain_rows, pkc, pvc, _ = _attend(plain, norms, seqs)
    assert kc.dtype == torch.float8_e4m3fn and pkc.dtype == dtype
    assert float(pvc.nan_to_num().abs().max()) > 448 and float(vc.float().nan_to_num().abs().max()) == 448
    for (q, past, *_), blk in zip(seqs, blocks):
        for got, want in zip(_written_kv(kc, vc, blk, q + past), _written_kv(pkc, pvc, blk, q + past)):
            assert torch.equal(to_cache(got, kc).view(torch.uint8), to_cache(want, kc).view(torch.uint8))
    _, ctx = build_context([[0] * s[0] for s in seqs], [s[1] for s in seqs], blocks, list(range(len(seqs))),
                           [s[2] for s in seqs], block_size=PAGE, device=device)
    want = ReferenceAttentionImpl(impl.spec).forward(torch.cat([s[5] for s in seqs]), *norms, kc.clone(), vc.clone(),
                                                     ctx)
    tol = 1e-4 if dtype == torch.float32 else 2.5e-2  # bf16: p and the output rounded to 8 bits
    wants = want.float().split([s[0] for s in seqs])

    def close(got_rows):  # each sequence's rows against its own scale (the third's values are past 448)
        return all(float((g.float() - w).abs().max()) < tol * float(w.abs().max()) for g, w in zip(got_rows, wants))

    assert close(rows)
    assert not any(torch.equal(a, b) for a, b in zip(rows, plain_rows))
    if dtype == torch.bfloat16:
        monkeypatch.setattr(attention, "FP8_KV_F16", False)
        bf16_rows, *_ = _attend(impl, norms, seqs)
        assert close(bf16_rows)
        assert not torch.equal(rows[0], bf16_rows[0]) and not torch.equal(rows[1], bf16_rows[1])  # decode, verify
        assert torch.equal(rows[2], bf16_rows[2])  # prompt rows: their own kernel, in q's dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_cache_at_checkpoint_scales_written_and_read_as_the_reference(device, dtype):
    """An FP8 cache at a checkpoint's calibrated k/v scales (kv_cache_scheme): the fused kernel
    stores each key and value times the float32 reciprocal of its scale, rounded as the reference
    rounds it (bitwise); decode, verify and prompt rows read it as the reference does (k_scale in
    the softmax scale, v_scale on the gated output); scales of 1 give the unscaled cache's bits
    exactly; other scales give other rows (negative control: the scales are live)."""
    from bi_core.backends.reference.attention import ReferenceAttentionImpl, to_cache
    from bi_core.runtime.batch import build_context

    scales = (0.37, 2.9)  # keys stored 2.7x larger, values 2.9x smaller: other e4m3 roundings than at 1
    impl, norms = _attention_impl(device, dtype, "fp8_e4m3", kv_scales=True)
    unscaled, _ = _attention_impl(device, dtype, "fp8_e4m3")
    plain, _ = _attention_impl(device, dtype)
    seqs = [_att_seq(1, 300, True, device, dtype), _att_seq(3, 40, True, device, dtype),
            _att_seq(20, 0, False, device, dtype)]
    rows, kc, vc, blocks = _attend(impl, norms, seqs, kv_scales=scales)
    plain_rows, pkc, pvc, _ = _attend(plain, norms, seqs)
    for (q, past, *_), blk in zip(seqs, blocks):
        got, want = _written_kv(kc, vc, blk, q + past), _written_kv(pkc, pvc, blk, q + past)
        for g, w, scale in zip(got, want, scales):
            assert torch.equal(to_cache(g, kc).view(torch.uint8), to_cache(w, kc, scale).view(torch.uint8))
    _, ctx = build_context([[0] * s[0] for s in seqs], [s[1] for s in seqs], blocks, list(range(len(seqs))),
                           [s[2] for s in seqs], block_size=PAGE, device=device)
    want = ReferenceAttentionImpl(impl.spec).forward(torch.cat([s[5] for s in seqs]), *norms, kc.clone(), vc.clone(),
                                                     ctx, kv_scales=scales)
    tol = 1e-4 if dtype == torch.float32 else 2.5e-2
    for g, w in zip(rows, want.float().split([s[0] for s in seqs])):
        assert float((g.float() - w).abs().max()) < tol * float(w.abs().max())
    ones, *_ = _attend(impl, norms, seqs, kv_scales=(1.0, 1.0))
    base, *_ = _attend(unscaled, norms, seqs)
    assert all(torch.equal(a, b) for a, b in zip(ones, base))
    assert not any(torch.equal(a, b) for a, b in zip(rows, ones))
    assert all(float((a.float() - b.float()).abs().max()) < 0.2 * float(b.float().abs().max())
               for a, b in zip(rows, plain_rows))  # still the attention of these keys and values


@pytest.mark.parametrize("run", [2, 8])
def test_long_rows_merge_in_runs_invariantly(device, monkeypatch, run):
    """Rows with more than ``MERGE_RUN`` chunks (long contexts) fold them in two levels, runs of
    ``run`` chunks first. With 64-key chunks a 5-token verify at positions 508..512 holds rows of
    8 and 9 chunks, so with runs of 8 one row takes two levels and the others one: the needle at
    512 gets the same bits alone, as the verify's last row, batched and permuted; each row stays
    the reference's attention; and two-level folding is a different arithmetic from one level
    (negative control: the run length is part of a long row's bits, so it may not follow the batch;
    runs of one chunk after the first are exact, so runs of 8 over 9 chunks keep one level's bits)."""
    from bi_core.backends.reference.attention import ReferenceAttentionImpl
    from bi_core.kernels import attention

    monkeypatch.setattr(attention, "KV_SPLIT", 64)
    monkeypatch.setattr(attention, "MERGE_RUN", run)
    dtype = torch.float32
    impl, norms = _attention_impl(device, dtype)
    verify = _att_seq(5, 508, True, device, dtype)
    (rows_v,), kc, vc, (blk,) = _attend(impl, norms, [verify], splits=2)
    needle = (1, 512, True, *_written_kv(kc, vc, blk, 512), verify[5][4:])
    (alone,), kc, vc, blk = _attend(impl, norms, [needle])
    assert torch.equal(rows_v[4:], alone)
    others = [_att_seq(1, 700, True, device, dtype), _att_seq(3, 130, True, device, dtype),
              _att_seq(7, 0, False, device, dtype)]
    _check_batched_and_permuted(impl, norms, needle, alone, others, seed=3, splits=(3, 2))
    # the reference on the same cache
    from bi_core.runtime.batch import build_context

    _, ctx = build_context([[0]], [512], blk, [0], [True], block_size=PAGE, device=device)
    kc2, vc2 = kc.clone(), vc.clone()
    want = ReferenceAttentionImpl(impl.spec).forward(needle[5], *norms, kc2, vc2, ctx)
    assert float((alone - want).abs().max()) < 1e-5
    monkeypatch.setattr(attention, "MERGE_RUN", 1 << 20)  # one level
    (serial,), *_ = _attend(impl, norms, [needle])
    assert float((serial - alone).abs().max()) < 1e-5
    # 9 chunks: runs of 2 fold (c0 c1)(c2 c3)...: other bits; runs of 8 leave c8 alone, and a
    # single chunk folds into an empty run exactly, so those are the one-level bits
    assert torch.equal(serial, alone) == (run == 8)


def _prompt_case(device, dtype, kv="auto"):
    """A 150-token prompt written by one chunk from position 0, the keys it wrote, and other
    sequences to batch its later chunk with (decode rows, a verify row, another prompt chunk)."""
    impl, norms = _attention_impl(device, dtype, kv)
    whole = _att_seq(150, 0, False, device, dtype)
    (rows,), kc, vc, (blk,) = _attend(impl, norms, [whole])
    others = [_att_seq(1, 300, True, device, dtype), _att_seq(3, 40, True, device, dtype),
              _att_seq(37, 90, False, device, dtype)]
    return impl, norms, whole, rows, _written_kv(kc, vc, blk, 150), others


@pytest.mark.parametrize("dtype,kv", [(torch.bfloat16, "auto"), (torch.float32, "auto"), (torch.float32, "fp8_e4m3"),
                                      (torch.bfloat16, "fp8_e4m3")])
def test_prompt_rows_invariant_across_batches_and_chunkings(device, dtype, kv, seed):
    """Prompt rows (``_prefill_fa_kernel``: one online softmax over 64-key blocks from position 0,
    tiles of ``prefill_tile_tokens``): positions 83..149 of a prompt give the same bits computed
    in the one 150-token chunk (tiles from token 0), as a later chunk after 83 tokens (tiles from
    83: other tile mates, another unmasked/masked split), alone, and at a random place in a batch
    with decode rows, a verify row and another prompt chunk, permuted too. With an FP8 cache too."""

    impl, norms, whole, rows, (pk, pv), others = _prompt_case(device, dtype, kv)
    later = (67, 83, False, pk[:83], pv[:83], whole[5][83:])
    (alone,), *_ = _attend(impl, norms, [later])
    assert torch.equal(alone, rows[83:])
    _check_batched_and_permuted(impl, norms, later, alone, others, seed, splits=(2, 2))


def test_prompt_rows_negative_control(device, monkeypatch):
    """A prompt kernel whose key block follows the batch (32 keys beside other sequences, 64
    alone): the later chunk's rows differ, and the check sees it."""
    from bi_core.kernels import attention

    impl, norms, whole, rows, (pk, pv), others = _prompt_case(device, torch.float32)
    later = (67, 83, False, pk[:83], pv[:83], whole[5][83:])
    (alone,), *_ = _attend(impl, norms, [later])
    monkeypatch.setattr(attention, "PREFILL_BLOCK_N", 32)
    got, *_ = _attend(impl, norms, [later] + others, splits=2)
    assert not torch.equal(got[0], alone)


# ------------------------------------------------------------------------------ GDN decode

GDN_SEQS = [(1, 5), (3, 6), (1, 0), (1, 9), (4, 2), (1, 3)]  # (query tokens, past): decode, verify, new


def _gdn_setup(device, dtype):
    from bi_core.ops.gdn import GdnSpec, GdnWeights

    spec = GdnSpec(dtype=dtype, device=device, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=32,
                   conv_kernel=4)
    width = spec.conv_dim + spec.value_dim + 2 * spec.num_v_heads
    projs = [torch.randn(q, width, device=device).to(dtype) for q, _ in GDN_SEQS]
    weights = GdnWeights(conv1d=(torch.randn(spec.conv_dim, 4, device=device) / 2).to(dtype),
                         A_log=torch.rand(spec.num_v_heads, device=device) * 2,
                         dt_bias=torch.randn(spec.num_v_heads, device=device),
                         norm=(1 + 0.1 * torch.randn(spec.head_v_dim, device=device)).to(dtype))
    conv0 = torch.randn(len(GDN_SEQS), spec.conv_dim, 3, device=device).to(dtype)
    state0 = torch.randn(len(GDN_SEQS), spec.num_v_heads, spec.head_v_dim, spec.head_k_dim, device=device)
    return spec, projs, weights, conv0, state0


def _gdn_step(spec, projs, weights, conv0, state0, rows, chunked=False):
    """Sequences ``rows`` in one recurrent step, sequence i in state slot i wherever it sits:
    (outputs [m, 4, value_dim] zero-padded past each sequence's tokens, states, conv windows)
    of those sequences. ``chunked``: the reference's chunked form instead of the kernel."""
    from bi_core.backends.reference.gdn import ReferenceGdnImpl
    from bi_core.kernels.gdn_decode import gdn_decode
    from bi_core.runtime.batch import build_context

    device, ids = conv0.device, rows.tolist()
    seqs = [GDN_SEQS[i] for i in ids]
    _, ctx = build_context([[0] * q for q, _ in seqs], [p for _, p in seqs], [[i] for i in ids], ids,
                           [not chunked] * len(ids), block_size=PAGE, device=device)
    proj = torch.cat([projs[i] for i in ids])
    conv, state = conv0.clone(), state0.clone()
    if chunked:
        out = ReferenceGdnImpl(spec).forward(proj, weights, conv, state, ctx)
    else:
        out = torch.full((proj.shape[0], spec.value_dim), float("nan"), dtype=proj.dtype, device=device)
        gdn_decode(proj, weights.conv1d, weights.A_log, weights.dt_bias, weights.norm, conv, state, ctx.cu_seqlens_q,
                   ctx.context_lens, ctx.state_slots, ctx.token_state_slots, ctx.recurrent_ids, out,
                   num_k_heads=spec.num_k_heads, head_k_dim=spec.head_k_dim, eps=1e-6, per_token=False)
    padded = torch.zeros(len(ids), 4, spec.value_dim, dtype=out.dtype, device=device)
    for j, rows_j in enumerate(out.split([q for q, _ in seqs])):
        padded[j, :rows_j.shape[0]] = rows_j
    return padded, state[rows], conv[rows]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_decode_rows_invariant(device, dtype):
    """The fused GDN decode kernel (conv, gates, delta rule, gated norm) over decode rows, new
    sequences and 3- and 4-token verify rows: each sequence's outputs, final state and conv
    window are the same bits alone, in the first m sequences and permuted."""
    setup = _gdn_setup(device, dtype)
    step = lambda rows: _gdn_step(*setup, rows)
    assert row_mismatches(step, len(GDN_SEQS), (1, 3), device) == []
    out, state, conv = step(torch.arange(len(GDN_SEQS), device=device))
    assert not out.isnan().any() and not torch.equal(state, setup[4])  # every row written, the states moved


def test_gdn_negative_control(device):
    """Choosing the GDN form by batch shape (the recurrent kernel for up to 3 sequences, the
    chunked form beyond) gives a sequence other bits in a larger batch: the check sees it."""
    setup = _gdn_setup(device, torch.float32)
    every = torch.arange(len(GDN_SEQS), device=device)
    recurrent, chunked = _gdn_step(*setup, every), _gdn_step(*setup, every, chunked=True)
    assert not torch.equal(recurrent[0], chunked[0])
    by_batch = lambda rows: _gdn_step(*setup, rows, chunked=rows.shape[0] > 3)
    assert row_mismatches(by_batch, len(GDN_SEQS), (1, 3), device)


# -------------------------------------------------------------------------------- sampler

SAMPLE_ROWS, VOCAB = 8, 10000  # two 8192-token vocabulary chunks


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampler_rows_invariant(device, dtype):
    """Greedy and Gumbel-max rows (noise keyed by the row's own key), the log-sum-exp and the
    (token, logprob) pairs: the same bits alone, in the first m rows and permuted."""
    from bi_core.kernels.sampling import sample

    logits = (2 * torch.randn(SAMPLE_ROWS, VOCAB, device=device)).to(dtype)
    keys = torch.randint(0, 2**62, (SAMPLE_ROWS,), device=device)
    temps = torch.rand(SAMPLE_ROWS, device=device) + 0.5
    temps[::3] = 0.0  # greedy rows too
    run = lambda rows: sample(logits[rows], keys[rows], temps[rows])
    assert row_mismatches(run, SAMPLE_ROWS, (1, 4), device) == []
    tokens, _, packed = run(torch.arange(SAMPLE_ROWS, device=device))
    assert torch.equal(packed[:, 0].long(), tokens)


def test_sampler_negative_control(device):
    """Keys drawn from one generator shared by the batch (row i gets the batch's i-th draw, as
    a batch-wide RNG stream gives): a row's token follows its place, and the check sees it."""
    from bi_core.kernels.sampling import sample

    logits = torch.randn(SAMPLE_ROWS, VOCAB, device=device)
    temps = torch.ones(SAMPLE_ROWS, device=device)

    def shared_stream(rows):
        keys = torch.randint(0, 2**62, (rows.shape[0],), generator=torch.Generator().manual_seed(0)).to(device)
        return sample(logits[rows], keys, temps[rows])[0]

    assert row_mismatches(shared_stream, SAMPLE_ROWS, (1,), device)


# --------------------------------------------------------------- SiLU-and-mul, output gate

@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_kernel(device, dtype):
    """``_silu_mul_kernel`` (after the cuBLAS gate_up GEMM of the default backend): torch's
    ``silu(gate) * up`` with its rounding, over two column programs (N = 1,500: 1,024 + a masked
    476) of strided rows; every row alone and permuted gives the batch's bits."""
    import torch.nn.functional as F

    from bi_core.kernels.elementwise import silu_mul

    n = 1500
    wide = torch.randn(9, 2 * n + 8, device=device).to(dtype)
    x = wide[:, :2 * n]  # row stride 2N + 8
    got = silu_mul(x)
    want = F.silu(x[:, :n]) * x[:, n:]
    # fp32: numpy's sigmoid vs torch's silu differ in the last bits; bf16: the interpreter
    # truncates each rounding (the GPU rounds to nearest even, dev/notebook.md)
    tol = 1e-6 if dtype == torch.float32 else (2e-2 if device.type == "cpu" else 1e-2)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert row_mismatches(lambda rows: silu_mul(x[rows]), x.shape[0], (1,), device) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_kernel(device, dtype):
    """``_gate_kernel`` (``apply_gate``, after FlashInfer's attention): ``o * sigmoid(gate)`` with
    transformers' rounding, each query head's gate read from its q_proj columns (h*2D + D ...);
    every row alone and permuted gives the batch's bits."""
    from bi_core.kernels.qk_norm_rope import apply_gate

    tokens = 7
    o = torch.randn(tokens, ATT_HQ, ATT_D, device=device).to(dtype)
    qkv = torch.randn(tokens, ATT_WIDTH, device=device).to(dtype)
    gate = qkv[:, ATT_D:]  # as the attention impls pass it
    got = apply_gate(o, gate)
    g = gate[:, :2 * ATT_HQ * ATT_D].reshape(tokens, ATT_HQ, 2 * ATT_D)[:, :, :ATT_D]
    want = (o * torch.sigmoid(g)).reshape(tokens, ATT_HQ * ATT_D)
    tol = 1e-6 if dtype == torch.float32 else (2e-2 if device.type == "cpu" else 1e-2)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert row_mismatches(lambda rows: apply_gate(o[rows], gate[rows]), tokens, (1,), device) == []


@pytest.mark.parametrize("preset", ["qwen3.5-0.8b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b",
                                    "qwen3.5-122b-a10b", "qwen3.5-397b-a17b"])
def test_exact_decode_length_fits_one_power_of_two_tile(preset):
    """The most tokens a step runs in decode form with decode's bits (``decode_query_len``: MTP
    verify, exact scoring, preemption rebuilds) makes a tile the kernel can launch: its MMA rows a
    power of two, within EXACT_DECODE_ROWS. Negative control: the earlier rule (rows // group
    tokens) gives 27B's 6 heads per KV head a 96-row tile, past the kernel's 64."""
    from bi_core.backends.cuda_common.attention import EXACT_DECODE_ROWS, exact_decode_tokens
    from bi_core.kernels.attention import M_ROWS, decode_rows, tokens_per_tile
    from bi_core.models.presets import preset_args

    a = preset_args(preset)
    group, tile = a.num_attention_heads // a.num_key_value_heads, tokens_per_tile(a.num_attention_heads,
                                                                                 a.num_key_value_heads)
    q = exact_decode_tokens(group, tile)
    for n in range(1, q + 1):  # every length up to it
        rows = decode_rows(n, group)
        assert rows <= EXACT_DECODE_ROWS <= M_ROWS and rows & (rows - 1) == 0, (n, rows)
    if preset == "qwen3.5-27b":
        assert q == 2 and decode_rows(min(tile, EXACT_DECODE_ROWS // group), group) > M_ROWS
