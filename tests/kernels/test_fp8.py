"""Block-FP8 W8A8 kernels (bi_core/kernels/fp8.py, fp8_moe.py), on the CPU through Triton's
interpreter or on a GPU.

- Quantization against a pure-torch reference, bitwise, on inputs that separate ties-to-even from
  other roundings.
- The GEMM against a float64 product of the dequantized operands, within a stated error bound.
- Under the interpreter, the GEMM bitwise against a numpy emulation of the documented arithmetic
  (K blocks in order, scales and fma, split ranges added in order), with ``ordered_dot``.
- Batch invariance, bitwise: every row alone, in batches of 1..264 rows (crossing the M buckets),
  permuted, and under every bucket's tiles, split programs vs INLINE. Negative controls: a split count that follows M, and a batch-wide activation
  scale, must be caught; constructed inputs where two K orders cannot round alike.
- The routed-expert MoE the same way: grouped rows within the bound, tokens bitwise across
  batch sizes (routing blocks of 16 to 128 rows, weight tiles by pointers and by TMA), with a
  per-tensor-scale negative control.
- GPU only (skipped here): the same at the model's shapes, M = 1..1024, and the same bits as a
  kernel in vLLM's order.

Under the interpreter the in-block dot is modelled (fp32, K order): the GPU's fp8 wgmma
accumulation is not, and neither is its behaviour across tile shapes (fp8.py's docstring)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import torch

from bi_core.quant.fp8_numerics import over_fp8_max

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py sets it without a GPU
BLK = 128
E4M3 = torch.float8_e4m3fn

pytestmark = pytest.mark.usefixtures("poisoned_empty")


@pytest.fixture(autouse=True)
def seed(request) -> int:
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------ references


def ref_quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and group of 128 columns: s = max(amax, 1e-10) / 448, q = e4m3(clamp(x / s))
    (torch's float32 division and its float8 cast: both round to nearest even)."""
    m, k = x.shape
    kb = cdiv(k, BLK)
    xp = torch.zeros(m, kb * BLK, dtype=torch.float32, device=x.device)
    xp[:, :k] = x.float()
    g = xp.view(m, kb, BLK)
    s = over_fp8_max(g.abs().amax(-1).clamp(min=1e-10))  # true division on a GPU too
    q = (g / s[..., None]).clamp(-448.0, 448.0).to(E4M3)
    return q.view(m, kb * BLK)[:, :k], s


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's layout: wq [N, K] e4m3, ws [ceil(N/128), ceil(K/128)], one scale per block."""
    n, k = w.shape
    nb, kb = cdiv(n, BLK), cdiv(k, BLK)
    wp = torch.zeros(nb * BLK, kb * BLK, device=w.device)
    wp[:n, :k] = w.float()
    blocks = wp.view(nb, BLK, kb, BLK)
    ws = over_fp8_max(blocks.abs().amax((1, 3)).clamp(min=1e-12))
    wq = (blocks / ws[:, None, :, None]).clamp(-448, 448).to(E4M3).view(nb * BLK, kb * BLK)
    return wq[:n, :k].contiguous(), ws


def dequant(q: torch.Tensor, s: torch.Tensor, row_block: int) -> torch.Tensor:
    """float64 q * s, s per (row // row_block, column // 128)."""
    r, k = q.shape
    full = s.double().repeat_interleave(row_block, 0)[:r].repeat_interleave(BLK, 1)[:, :k]
    return q.double() * full


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma, one rounding (Triton's interpreter's own C helper)."""
    from triton._C.libtriton import interpreter

    a, b, c = (np.ascontiguousarray(v, dtype=np.float32) for v in np.broadcast_arrays(a, b, c))
    return interpreter.fma_fp32(a, b, c)


def emulate_gemm(xq, xs, wq, ws, split: int) -> torch.Tensor:
    """fp8.py's documented arithmetic in numpy, the in-block dot summed in K order (the
    interpreter's ``ordered_dot``): per split range, from zero, for each K block in order
    ``acc = fma(dot * xs, ws, acc)``; the ranges' sums added in range order."""
    m, k = xq.shape
    n = wq.shape[0]
    kb = cdiv(k, BLK)
    pad = lambda t: np.pad(t.float().cpu().numpy(), ((0, 0), (0, kb * BLK - k)))  # exact e4m3 values
    a, w = pad(xq), pad(wq)
    a_s, w_s = xs.cpu().numpy(), ws.cpu().numpy()[np.arange(n) // BLK]  # [M, KB], [N, KB]
    per = cdiv(kb, split)
    total = None
    for s in range(split):
        acc = np.zeros((m, n), np.float32)
        for b in range(s * per, min(kb, (s + 1) * per)):
            cols = slice(b * BLK, (b + 1) * BLK)
            prods = a[:, None, cols] * w[None, :, cols]  # [M, N, 128], exact
            dot = np.cumsum(prods, axis=-1)[..., -1] + np.float32(0)  # a sequential fp32 sum, + the zero acc
            acc = _fma32(dot * a_s[:, b, None], w_s[None, :, b], acc)
        total = acc if total is None else total + acc
    return torch.from_numpy(total)


def row_mismatches(fn, num_rows: int, sizes, device, variants=()) -> list[str]:
    """``fn(rows)`` -> tensor(s), one row per index in ``rows``. The first m rows at each size, a
    permutation and each variant (other launch shapes of the whole batch) against the whole batch,
    bitwise; returns what differed (empty: invariant)."""
    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)
    every = torch.arange(num_rows, device=device)
    ref = as_tuple(fn(every))
    bad = []
    for j, variant in enumerate(variants):
        bad += [f"output {i}, variant {j}" for i, (a, b) in enumerate(zip(as_tuple(variant(every)), ref))
                if not torch.equal(a, b)]
    for m in sizes:
        bad += [f"output {i}, first {m} rows" for i, (a, b) in enumerate(zip(as_tuple(fn(every[:m])), ref))
                if not torch.equal(a, b[:m])]
    perm = torch.randperm(num_rows, device=device)
    bad += [f"output {i}, permuted" for i, (a, b) in enumerate(zip(as_tuple(fn(perm)), ref))
            if not torch.equal(a, b[perm])]
    return bad


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so -0.0 != 0.0 and NaN == NaN compare as the bits they are."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# --------------------------------------------------------------------------- quantization


def _ties_group(device) -> torch.Tensor:
    """128 values with amax 448 (so the scale is exactly 1 and x / s = x): every midpoint
    between neighbouring positive e4m3 values from the subnormals up (ties), each negated,
    and a float32 step either side of some, so rounding itself is what is checked."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448, increasing
    mids = (grid[1:] + grid[:-1]) / 2  # 126 exact midpoints
    pick = mids[torch.randperm(126)[:60]]
    near = torch.cat([torch.nextafter(pick[:16], torch.tensor(1e9)), torch.nextafter(pick[16:32], torch.tensor(0.0))])
    vals = torch.cat([torch.tensor([448.0, -0.0, 2.0**-10, -(2.0**-10), 3 * 2.0**-10]), pick, -pick[:31], near])
    return vals[:BLK].to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [128, 320])
def test_quantize_act_bitwise(device, dtype, k):
    """quantize_act equals the torch reference bit for bit: random groups spanning e4m3's range
    (subnormals included), an all-zero row, -0.0, a ragged last group (K=320), a strided input,
    and a group of exact ties (amax 448: scale 1) whose round-half-up differs from ties-to-even."""
    from bi_core.kernels.fp8 import quantize_act

    rows = 23
    x = torch.randn(rows, k, device=device) * torch.exp2(torch.randint(-20, 12, (rows, 1), device=device).float())
    x[:, 5] *= 2.0 ** torch.randint(-12, 6, (rows,), device=device).float()  # a larger spread inside a group
    x[2] = 0.0
    x[3, :7] = -0.0
    ties = _ties_group(device)
    x[4, :BLK] = ties
    x[5, :BLK] = -ties
    wide = torch.full((rows, k + 64), float("nan"), device=device).to(dtype)
    wide[:, :k] = x.to(dtype)
    xin = wide[:, :k]  # row stride k + 64
    xq, xs = quantize_act(xin)
    rq, rs = ref_quantize_act(xin)
    assert xq.dtype == E4M3 and xs.dtype == torch.float32 and xs.shape == (rows, cdiv(k, BLK))
    assert torch.equal(bits(xs), bits(rs))
    assert torch.equal(bits(xq), bits(rq))
    assert torch.equal(bits(xq[3, :7]), torch.full((7,), 0x80, dtype=torch.uint8, device=device))  # -0.0 kept
    # the ties have teeth: rounding them half away from zero would change many of them
    if dtype == torch.float32:
        t = x[4, :BLK].double()
        step = torch.where(t.abs() < 2.0**-6, 2.0**-9, torch.exp2(torch.floor(torch.log2(t.abs().clamp(min=1e-30))) - 3))
        half_up = (torch.sign(t) * torch.floor(t.abs() / step + 0.5) * step).float()
        assert (half_up != rq[4, :BLK].float()).sum() > 20
    empty_q, empty_s = quantize_act(torch.empty(0, k, device=device, dtype=dtype))
    assert empty_q.shape == (0, k) and empty_s.shape == (0, cdiv(k, BLK))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [256, 320])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_fp8_copy_is_quantize_act_of_its_output(device, dtype, k, residual):
    """The norm that feeds FP8 projections (kernels/norm.py ``rms_norm_fp8``, one launch) returns
    rms_norm's output and residual sum bitwise, and its FP8 copy is ``quantize_act`` of that output
    bit for bit (values and scales), rows of any scale, an all-zero row and a ragged last group (K
    = 320) included: the projections that take the copy compute what they would have. Negative
    control: the copy of an output quantized in a different grouping (per row) differs."""
    from bi_core.kernels.fp8 import quantize_act
    from bi_core.kernels.norm import rms_norm, rms_norm_fp8

    rows = 19
    x = (torch.randn(rows, k, device=device) * torch.exp2(torch.randint(-8, 8, (rows, 1), device=device).float())).to(dtype)
    x[2] = 0.0
    r = torch.randn(rows, k, device=device).to(dtype) if residual else None
    if residual:
        r[2] = 0.0
    w = (0.5 * torch.randn(k, device=device)).to(dtype)
    w[: k // 4] *= 40  # groups of very different size within a row
    y, r_sum, yq, ys = rms_norm_fp8(x, w, 1e-6, residual=r)
    if residual:
        want_y, want_r = rms_norm(x, w, 1e-6, residual=r)
        assert torch.equal(r_sum, want_r)
    else:
        want_y, want_r = rms_norm(x, w, 1e-6), None
        assert r_sum is None
    assert torch.equal(y, want_y)
    q, s = quantize_act(y)
    assert yq.dtype == E4M3 and ys.shape == (rows, cdiv(k, BLK))
    assert torch.equal(bits(ys), bits(s)) and torch.equal(bits(yq), bits(q))
    per_row = over_fp8_max(y.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-10))
    assert not torch.equal(bits((y.float() / per_row).clamp(-448, 448).to(E4M3)), bits(yq))


@pytest.mark.parametrize("m", [1, 8, 40])
def test_linears_write_into_columns_of_a_wider_buffer(device, m):
    """``out=`` (LinearImpl's ``writes_into``: the official FP8 GDN's two input projections write
    side by side, no concatenation): the block-FP8 linear, the FP8 GEMM on a norm's copy and the
    bf16 GEMM write their columns of a wider buffer with the bits they return alone, and touch
    no other column (the NaNs around them stay)."""
    from bi_core.kernels.fp8 import fp8_gemm, fp8_linear, quantize_act
    from bi_core.kernels.gemm import linear
    from bi_core.quant.fp8_numerics import quantize_blocks

    g = torch.Generator(device="cpu").manual_seed(m)
    x = torch.randn(m, 256, generator=g).to(device=device, dtype=torch.bfloat16)
    wq, ws = quantize_blocks(torch.randn(384, 256, generator=g).to(device) / 16, (128, 128))
    wb = (torch.randn(64, 256, generator=g) / 16).to(device=device, dtype=torch.bfloat16)
    buf = torch.full((m, 384 + 64 + 16), float("nan"), device=device, dtype=torch.bfloat16)
    fp8_linear(x, wq, ws, out=buf[:, :384])
    linear(x, wb, out=buf[:, 384:448])
    assert torch.equal(buf[:, :384], fp8_linear(x, wq, ws)) and torch.equal(buf[:, 384:448], linear(x, wb))
    assert bool(buf[:, 448:].isnan().all())
    fp8_gemm(*quantize_act(x), wq, ws, torch.bfloat16, out=buf[:, 64:448])
    assert torch.equal(buf[:, 64:448], fp8_linear(x, wq, ws))


def test_quantize_negative_control(device):
    """The harness catches a quantizer whose scale spans the batch (per-tensor dynamic, what
    breaks invariance in the libraries), while quantize_act passes it."""
    from bi_core.kernels.fp8 import quantize_act

    x = torch.randn(40, 256, device=device) * torch.exp2(torch.randint(-4, 4, (40, 1), device=device).float())

    def per_tensor(rows):
        a = x[rows]
        s = over_fp8_max(a.abs().amax().clamp(min=1e-10))
        return (a / s).clamp(-448, 448).to(E4M3).view(torch.uint8), s.expand(a.shape[0])

    assert row_mismatches(lambda rows: tuple(map(bits, quantize_act(x[rows]))), 40, (1, 7, 16), device) == []
    assert row_mismatches(per_tensor, 40, (1, 7, 16), device)


# ---------------------------------------------------------------------------------- GEMM

GEMM_SHAPES = [(7, 128, 128), (9, 200, 320), (33, 256, 384), (20, 136, 1024)]  # the last: SPLIT_K 2


def _weights(n: int, k: int, device):
    w = torch.randn(n, k, device=device) / k**0.5
    w[:, : min(k, BLK)] *= 8.0  # blocks of different scales
    return quantize_weight(w)


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_gemm_numerics(device, shape):
    """fp8_gemm (fp32 and bf16 outputs) against the float64 product of the dequantized operands.
    Bound, per element: |y - ref| <= (128 + KB + 3) * u * Σ_k |x_k w_k| + r * |ref|. The products
    of e4m3 values are exact in fp32; each block's 128-term sum, its two scale products and the KB
    accumulations (and split sums) each add at most one rounding of u relative to the running
    |sum| <= Σ|x w| (first order); r: the output rounding (fp32: none beyond u; bf16: 2**-7, as
    the interpreter truncates to bf16 where the GPU rounds). u = 2**-24 for fp32 sums; on the GPU
    the fp8 wgmma keeps fewer accumulator bits inside a block (about 14 per DeepSeek-V3's report,
    not measured here), so u = 2**-13 there. The bound must be tight enough to fail a wrong scale
    (the last K block's weight scales doubled). fp8_linear on the unquantized activation equals
    quantize_act + fp8_gemm bitwise."""
    from bi_core.kernels.fp8 import fp8_config, fp8_gemm, fp8_linear, quantize_act

    m, n, k = shape
    wq, ws = _weights(n, k, device)
    x = torch.randn(m, k, device=device)
    xq, xs = quantize_act(x)
    xd, wd = dequant(xq, xs, 1), dequant(wq, ws, BLK)
    ref = xd @ wd.T
    mag = xd.abs() @ wd.abs().T
    u = 2.0**-24 if device.type == "cpu" else 2.0**-13
    for out_dtype, r in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-7)):
        buf = torch.full((m, n + 24), float("nan"), dtype=out_dtype, device=device)
        y = fp8_gemm(xq, xs, wq, ws, out_dtype, out=buf[:, :n])
        assert y.data_ptr() == buf.data_ptr() and buf[:, n:].isnan().all()  # wrote its columns only
        tol = (BLK + cdiv(k, BLK) + 3) * u * mag + r * ref.abs() + 1e-30
        err = (y.double() - ref).abs()
        assert (err <= tol).all(), f"{out_dtype}: max err/tol {(err / tol).max().item():.3g}"
    ws_wrong = ws.clone()
    ws_wrong[:, -1] *= 2.0  # as if the last K block's scales were read from another block
    wrong = fp8_gemm(xq, xs, wq, ws_wrong, torch.float32)
    assert ((wrong.double() - ref).abs() > (BLK + cdiv(k, BLK) + 3) * u * mag).any()
    assert fp8_config(m, n, k)["SPLIT_K"] == (2 if k == 1024 else 1)
    xb = x.to(torch.bfloat16)
    want = fp8_gemm(*quantize_act(xb), wq, ws, torch.bfloat16)
    assert torch.equal(bits(fp8_linear(xb, wq, ws)), bits(want))
    assert fp8_linear(xb[:0], wq, ws).shape == (0, n)


@pytest.mark.skipif(not INTERPRET, reason="the GPU's in-block fp8 dot is the hardware's, not a K-ordered fp32 sum")
@pytest.mark.usefixtures("ordered_dot")
@pytest.mark.parametrize("shape, split", [((9, 200, 320), 1), ((5, 136, 1024), 2), ((5, 136, 960), 3)],
                         ids=["ragged", "split2", "split3"])
def test_fp8_gemm_arithmetic_bitwise(device, shape, split):
    """Under the interpreter, with a K-ordered dot, the GEMM is bit for bit the documented
    arithmetic (numpy emulation): per block a dot from zero, ``fma(dot * xs, ws, acc)``, blocks in
    ascending order; split ranges of ceil(KB / SPLIT_K) blocks (3 over K = 960: 3, 3 and a ragged
    2) added in range order, by the fix-up program or INLINE, and through fp8_linear."""
    from bi_core.kernels.fp8 import fp8_config, fp8_gemm, fp8_linear, quantize_act

    m, n, k = shape
    wq, ws = _weights(n, k, device)
    x = torch.randn(m, k, device=device) * torch.exp2(torch.randint(-3, 3, (m, 1), device=device).float())
    xq, xs = quantize_act(x)
    want = bits(emulate_gemm(xq, xs, wq, ws, split))
    cfg = {**fp8_config(m, n, k), "SPLIT_K": split}
    assert torch.equal(bits(fp8_gemm(xq, xs, wq, ws, torch.float32, config={**cfg, "INLINE": False})), want)
    assert torch.equal(bits(fp8_linear(x, wq, ws, config={**cfg, "INLINE": split > 1})), want)


@pytest.mark.usefixtures("ordered_dot")
def test_fp8_tma_rows_equal_the_pointer_and_decode_rows(device, monkeypatch):
    """From TMA_MIN_M rows the GEMM loads its FP8 tiles by TMA (``_fp8_gemm_tma_kernel``: TMA_TILE,
    ranges added in the program): bitwise the documented arithmetic (numpy emulation), the
    pointer kernel with the same tiles, and each row computed alone (swapped dots, split programs
    and the fix-up), over a ragged N and K (the blocks past them read as zeros by TMA), unsplit
    and split. Negative control: another split count differs."""
    from bi_core.kernels import fp8
    from bi_core.kernels.fp8 import TMA_MIN_M, TMA_TILE, fp8_config, fp8_gemm, fp8_linear, quantize_act

    if not INTERPRET and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs SM90")
    monkeypatch.setattr(fp8, "TMA_MIN_N", INV_N)  # the TMA tiles at this test's narrow N
    wq, ws = _weights(INV_N, INV_K, device)
    x = torch.randn(TMA_MIN_M + 9, INV_K, device=device) * torch.exp2(
        torch.randint(-4, 4, (TMA_MIN_M + 9, 1), device=device).float())
    xq, xs = quantize_act(x)
    gemm = lambda rows, cfg: fp8_gemm(xq[rows], xs[rows], wq, ws, torch.float32, config=cfg)
    every = torch.arange(x.shape[0], device=device)
    for split in (1, INV_SPLIT):
        cfg = {**fp8_config(x.shape[0], INV_N, INV_K), "SPLIT_K": split}
        assert cfg["TMA"] and cfg["INLINE"] and (cfg["BLOCK_M"], cfg["BLOCK_N"]) == TMA_TILE[:2]
        full = gemm(every, cfg)
        if INTERPRET:
            assert torch.equal(bits(full), bits(emulate_gemm(xq, xs, wq, ws, split)))
        assert torch.equal(bits(full), bits(gemm(every, {**cfg, "TMA": False})))
        for i in (0, 1, 63, 64, 128, x.shape[0] - 1):
            alone = {**fp8_config(1, INV_N, INV_K), "SPLIT_K": split, "INLINE": False}
            assert torch.equal(bits(gemm(every[i:i + 1], alone)), bits(full[i:i + 1])), f"row {i}, split {split}"
        assert torch.equal(bits(fp8_linear(x, wq, ws, config=cfg)), bits(full))
    assert not torch.equal(gemm(every, {**cfg, "SPLIT_K": 1}), full)


# ------------------------------------------------------------------------- batch invariance

INV_N, INV_K = 136, 320  # ragged N (two weight-scale rows) and K (a 64-column last group)
INV_SPLIT = 2  # the K order the invariance tests fix: ranges of 2 and 1 blocks (fp8_config's is 1 here)
INV_ROWS = 264  # past the 256-row bucket edge
INV_SIZES = (1, 3, 64, 65, 257)  # each bucket, and both sides of its edges
VARIANT_ROWS = 24  # the other buckets' launch shapes run on the first rows


def test_config_k_order_fixed_by_n_k():
    """SPLIT_K (the K order: BLOCK_K is always 128) is the same at every M for the model's shapes
    and the tests'; the in-block dots stay on one instruction (the fp8 wgmma): BLOCK_M is never
    below 64, or the dot is swapped with at least 64 weight rows as its M side; the buckets give
    the invariance test several launch shapes, swapped and not."""
    from bi_core.kernels.fp8 import fp8_config, split_k_for

    ms = list(range(1, 1100)) + [4096, 16384, 65536, 1 << 20]
    for n, k in [(2048, 2048), (4096, 2048), (2048, 512), (1024, 2048), (17408, 5120), (5120, 17408),
                 (248320, 2048), (INV_N, INV_K), (136, 1024), (200, 320)]:
        cfgs = [fp8_config(m, n, k) for m in ms]
        assert {c["SPLIT_K"] for c in cfgs} == {split_k_for(n, k)}
        assert all(c["BLOCK_N"] >= 64 if c["SWAP"] else c["BLOCK_M"] >= 64 for c in cfgs)
        assert {c["SWAP"] for c in cfgs} == {True, False}
    assert split_k_for(2048, 2048) == 4 and split_k_for(136, 1024) == 2
    shapes = {tuple(fp8_config(m, INV_N, INV_K)[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps", "SWAP"))
              for m in INV_SIZES + (INV_ROWS,)}
    assert len(shapes) >= 3, shapes  # the invariance tests add INLINE variants of their own


def invariance_mismatches(fn, num_rows: int, sizes, device, variants=()) -> list[str]:
    """``fn(rows, cfg)`` -> tensor(s), one row per index in ``rows``, under the tile table
    (cfg None) or a config override. Against the whole batch under the table, bitwise: the first
    m rows at each size, a permutation, and the first VARIANT_ROWS rows under each variant
    config (other buckets' launch shapes). Returns what differed (empty: invariant)."""
    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)
    every = torch.arange(num_rows, device=device)
    ref = as_tuple(fn(every, None))
    checks = [(f"first {m} rows", every[:m], None) for m in sizes]
    checks.append(("permuted", torch.randperm(num_rows, device=device), None))
    checks += [(f"variant {j}", every[:VARIANT_ROWS], cfg) for j, cfg in enumerate(variants)]
    bad = []
    for name, rows, cfg in checks:
        bad += [f"output {i}, {name}" for i, (a, b) in enumerate(zip(as_tuple(fn(rows, cfg)), ref))
                if not torch.equal(bits(a), bits(b[rows]))]
    return bad


def _inv_inputs(device):
    wq, ws = _weights(INV_N, INV_K, device)
    x = torch.randn(INV_ROWS, INV_K, device=device) * torch.exp2(torch.randint(-4, 4, (INV_ROWS, 1), device=device).float())
    return x, wq, ws


def _inv_config(m: int, **over) -> dict:
    from bi_core.kernels.fp8 import fp8_config

    return {**fp8_config(m, INV_N, INV_K), "SPLIT_K": INV_SPLIT, **over}


@pytest.mark.usefixtures("ordered_dot")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_invariant(device, dtype):
    """Each row of fp8_linear (and its quantize_act) is bitwise the same alone, in the first 3..257
    rows, in all 264, permuted, and under the other buckets' launch shapes: swapped dots on 16-row
    tiles, 64 x 32 tiles, 64-row and 128-row tiles with 4 and 8 warps, split programs with a fix-up
    vs INLINE (the K order, 2 ranges, fixed throughout). fp32
    outputs are the ones with teeth (bf16 hides most order changes); bf16 checks the bf16 input
    and output paths on 65 rows."""
    from bi_core.kernels.fp8 import fp8_linear, quantize_act

    x, wq, ws = _inv_inputs(device)
    xd = x.to(dtype)

    def run(rows, cfg):
        a = xd[rows]
        return (fp8_linear(a, wq, ws, config=cfg or _inv_config(a.shape[0])), *quantize_act(a))

    if dtype == torch.float32:
        rows, sizes = INV_ROWS, INV_SIZES
        variants = [_inv_config(1),  # swapped dots, 16-row tiles (two of them)
                    _inv_config(1, SWAP=False, BLOCK_M=64, BLOCK_N=32, INLINE=True), _inv_config(100),
                    _inv_config(INV_ROWS), _inv_config(INV_ROWS, BLOCK_N=128, INLINE=True)]
    else:  # 65 rows: the small bucket's edge
        rows, sizes, variants = 65, (1, 64), [_inv_config(INV_ROWS)]
    assert invariance_mismatches(run, rows, sizes, device, variants) == []


@pytest.mark.usefixtures("ordered_dot")
def test_fp8_negative_control_split_follows_m(device):
    """A split count that follows M (2 ranges up to 16 rows, 1 beyond, as an M-keyed heuristic
    would) changes the K order of the rows of a larger batch: the harness must see it (fp32)."""
    from bi_core.kernels.fp8 import fp8_linear

    x, wq, ws = _inv_inputs(device)
    x = x[:40]
    every = torch.arange(40, device=device)
    gemm = lambda rows, split: fp8_linear(x[rows], wq, ws, config=_inv_config(rows.shape[0], SPLIT_K=split))
    assert not torch.equal(gemm(every, 1), gemm(every, 2))
    by_batch = lambda rows, cfg: gemm(rows, 2 if rows.shape[0] <= 16 else 1)
    assert invariance_mismatches(by_batch, 40, (1,), device)


def test_fp8_negative_control_constructed(device):
    """Inputs on which the two K orders cannot round alike, whatever the dot: row 0, column 0 has
    block sums 2**24, 0, 1, 1 (one product each, scales 2**12 * 2**12 on block 0). In order:
    (2**24 + 1) ties to 2**24 twice, giving 2**24; two ranges: 2**24 + (1 + 1) = 2**24 + 2. A
    batch that switched split counts would return one or the other for the same row."""
    from bi_core.kernels.fp8 import fp8_config, fp8_gemm

    m, n, k = 3, 128, 512
    xq = torch.zeros(m, k, device=device)
    wq = torch.zeros(n, k, device=device)
    xq[0, [0, 256, 384]] = 1.0
    wq[0, [0, 256, 384]] = 1.0
    xq, wq = xq.to(E4M3), wq.to(E4M3)
    xs = torch.ones(m, 4, device=device)
    ws = torch.ones(1, 4, device=device)
    xs[0, 0] = ws[0, 0] = 2.0**12
    cfg = fp8_config(m, n, k)
    one = fp8_gemm(xq, xs, wq, ws, torch.float32, config={**cfg, "SPLIT_K": 1})
    two = fp8_gemm(xq, xs, wq, ws, torch.float32, config={**cfg, "SPLIT_K": 2})
    assert one[0, 0].item() == 2.0**24 and two[0, 0].item() == 2.0**24 + 2
    assert torch.equal(one[1:], two[1:]) and torch.equal(one[0, 1:], two[0, 1:])  # zeros elsewhere


# ------------------------------------------------------------------------------------ MoE

MOE_E, MOE_TOPK, MOE_H, MOE_I, MOE_TOKENS = 3, 2, 256, 128, 22  # + a shared expert: 4 experts, 3 slots, 66 pairs


def _moe_inputs(device):
    from bi_core.kernels.topk import softmax_topk

    x = torch.randn(MOE_TOKENS, MOE_H, device=device)
    x *= torch.exp2(torch.randint(-3, 3, (MOE_TOKENS, 1), device=device).float())
    logits = x @ (torch.randn(MOE_E + 1, MOE_H, device=device) / MOE_H**0.5).T
    w13 = [quantize_weight(torch.randn(2 * MOE_I, MOE_H, device=device) / MOE_H**0.5) for _ in range(MOE_E + 1)]
    w2 = [quantize_weight(torch.randn(MOE_H, MOE_I, device=device) / MOE_I**0.5) for _ in range(MOE_E + 1)]
    stack = lambda ws, i: torch.stack([w[i] for w in ws])
    wts, ids = softmax_topk(logits[:, :MOE_E], MOE_TOPK)
    return x, logits[:, MOE_E], wts, ids, stack(w13, 0), stack(w13, 1), stack(w2, 0), stack(w2, 1)


def test_fp8_moe_numerics(device):
    """The grouped GEMM: each pair's row against the float64 product of its token's dequantized
    row and its expert's dequantized weight, within test_fp8_gemm_numerics's bound; the SiLU-and-
    mul epilogue against moe.py's rounding applied to the plain gate and up GEMMs (fp32: equal up
    to the sigmoid's last place); the whole fused MoE against a float64 MoE on the dequantized
    weights and unquantized activations within 0.1 relative (the activations' e4m3 rounding, up
    to 2**-4 of each value, in both GEMMs), which a wrong expert, slot or gate would miss by far."""
    from bi_core.kernels.fp8 import quantize_act
    from bi_core.kernels.fp8_moe import fp8_fused_moe, fp8_grouped_gemm
    from bi_core.kernels.moe import align

    tokens = 6  # 18 pairs
    x, shared, wts, ids, w13, s13, w2, s2 = _moe_inputs(device)
    x, shared, wts, ids = x[:tokens], shared[:tokens], wts[:tokens], ids[:tokens]
    routing = align(ids, MOE_E + 1, shared=True)
    slots = MOE_TOPK + 1
    expert = torch.cat([ids, torch.full((tokens, 1), MOE_E, device=device, dtype=ids.dtype)], 1).reshape(-1)
    xq, xs = quantize_act(x)
    xd = dequant(xq, xs, 1)
    gate = fp8_grouped_gemm(xq, xs, w13[:, :MOE_I], s13[:, : MOE_I // BLK], routing, slots, out_dtype=torch.float32)
    u = 2.0**-24 if device.type == "cpu" else 2.0**-13
    for p in range(routing.num_pairs):
        e = int(expert[p])
        wd = dequant(w13[e, :MOE_I], s13[e, : MOE_I // BLK], BLK)
        ref, mag = xd[p // slots] @ wd.T, xd[p // slots].abs() @ wd.abs().T
        assert ((gate[p].double() - ref).abs() <= (BLK + cdiv(MOE_H, BLK) + 3) * u * mag + 1e-30).all(), p
    up = fp8_grouped_gemm(xq, xs, w13[:, MOE_I:], s13[:, MOE_I // BLK:], routing, slots, out_dtype=torch.float32)
    h = fp8_grouped_gemm(xq, xs, w13, s13, routing, slots, silu_mul=True, out_dtype=torch.float32)
    torch.testing.assert_close(h, gate * torch.sigmoid(gate) * up, rtol=1e-6, atol=0)
    y = fp8_fused_moe(x, wts, ids, w13, s13, w2, s2, shared)
    ref = torch.zeros(tokens, MOE_H, dtype=torch.float64, device=device)
    for t in range(tokens):
        for e, weight in [(int(ids[t, j]), float(wts[t, j])) for j in range(MOE_TOPK)] + [(MOE_E, None)]:
            g13 = dequant(w13[e], s13[e], BLK) @ x[t].double()
            out = dequant(w2[e], s2[e], BLK) @ (torch.nn.functional.silu(g13[:MOE_I]) * g13[MOE_I:])
            ref[t] += out * (weight if weight is not None else torch.sigmoid(shared[t].double()))
    assert float((y.double() - ref).norm() / ref.norm()) < 0.1


@pytest.mark.usefixtures("ordered_dot")
def test_fp8_moe_rows_invariant(device):
    """fp8_fused_moe (with a shared expert, fp32): a token's output is bitwise the same alone and in
    8 tokens (per pair: no routing sort), in all 22 (66 pairs,
    sorted: 32-row blocks), permuted, with 128-row tiles on 8 warps, with the weight tiles by TMA,
    sorted with swapped
    dots (16-row routing blocks), and either path forced on the same tokens. Negative control: the same pipeline written out, which equals
    fp8_fused_moe with quantize_act, gives a token different bits alone and among 8 when the
    activation scale spans the batch (per-tensor)."""
    from bi_core.kernels.fp8 import quantize_act
    from bi_core.kernels.fp8_moe import fp8_fused_moe, fp8_grouped_gemm
    from bi_core.kernels.moe import align, moe_combine

    x, shared, wts, ids, w13, s13, w2, s2 = _moe_inputs(device)
    run = lambda rows, cfg=None: fp8_fused_moe(x[rows], wts[rows], ids[rows], w13, s13, w2, s2, shared[rows],
                                               config=cfg)
    every = torch.arange(MOE_TOKENS, device=device)
    assert [align(ids[:m], MOE_E + 1, shared=True).block_m for m in (1, 8, MOE_TOKENS)] == [16, 16, 32]
    ref = bits(run(every))
    first8 = run(every[:8])
    assert torch.equal(bits(first8), ref[:8])
    assert torch.equal(bits(run(every[:1])), ref[:1])
    perm = torch.randperm(MOE_TOKENS, device=device)
    assert torch.equal(bits(run(perm)), ref[perm])
    assert torch.equal(bits(run(every[:12], {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "SWAP": False})), ref[:12])
    if INTERPRET or torch.cuda.get_device_capability()[0] >= 9:  # the weight tiles by TMA (gate, up, down)
        tma = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "SWAP": False, "TMA": True}
        assert torch.equal(bits(run(every, tma)), ref)
        assert torch.equal(bits(run(perm[:12], {**tma, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8})), ref[perm[:12]])
    assert align(ids[:12], MOE_E + 1, shared=True).block_m == 16  # sorted, swapped (16 rows against 128 weight rows)
    assert torch.equal(bits(run(every[:12], {"BLOCK_M": 16, "BLOCK_N": 128, "SWAP": True, "TMA": False})), ref[:12])
    assert torch.equal(bits(run(perm[:12], {"BLOCK_M": 16, "BLOCK_N": 64, "SWAP": True, "TMA": True})), ref[perm[:12]])
    with pytest.raises(AssertionError, match="SWAP"):  # the sorted path refuses a tile off the wgmma too
        run(every[:12], {"BLOCK_M": 16, "BLOCK_N": 32, "SWAP": True})
    per_pair = lambda rows, forced: fp8_fused_moe(x[rows], wts[rows], ids[rows], w13, s13, w2, s2, shared[rows],
                                                  per_pair=forced)
    assert torch.equal(bits(per_pair(every[:3], True)), ref[:3])  # the per-pair path (the default up to 8)
    assert torch.equal(bits(per_pair(every[:3], False)), ref[:3])  # ... and the sorted one on the same tokens
    assert torch.equal(bits(per_pair(perm[:8], True)), ref[perm[:8]])
    from bi_core.kernels.fp8_moe import PAIR_DOWN, PAIR_UP, _fp8_moe_per_pair

    rows = perm[:5]  # the per-pair path under other tiles: swapped (64 or 128 weight rows) and not
    # the weight tiles by TMA (the default; on SM90 and in the interpreter, else by pointers) and by pointers
    tma, ptr = {"TMA": True}, {"TMA": False}
    for up, down in (({"BLOCK_N": 128, **ptr}, {"BLOCK_N": 64, **ptr}), (ptr, ptr),
                     ({"BLOCK_N": 32, "SWAP": False, **ptr}, {"BLOCK_N": 64, "SWAP": False, **ptr}),
                     ({"BLOCK_N": 128, **tma}, {"BLOCK_N": 64, "SWAP": False, **tma})):
        other = _fp8_moe_per_pair(x[rows], wts[rows], ids[rows], w13, s13, w2, s2, shared[rows],
                                  {**PAIR_UP, **up}, {**PAIR_DOWN, **down})
        assert torch.equal(bits(other), ref[rows]), (up, down)
    with pytest.raises(AssertionError, match="SWAP"):  # a swapped dot on 32 weight rows is no wgmma
        _fp8_moe_per_pair(x[rows], wts[rows], ids[rows], w13, s13, w2, s2, shared[rows], PAIR_UP,
                          {**PAIR_DOWN, "BLOCK_N": 32})

    def per_tensor(a):
        s = over_fp8_max(a.abs().amax().clamp(min=1e-10))
        return (a / s).clamp(-448, 448).to(E4M3), s.expand(a.shape[0], cdiv(a.shape[1], BLK)).contiguous()

    def pipeline(rows, quant):
        routing = align(ids[rows], MOE_E + 1, shared=True)
        h = fp8_grouped_gemm(*quant(x[rows]), w13, s13, routing, MOE_TOPK + 1, silu_mul=True, out_dtype=x.dtype)
        return moe_combine(fp8_grouped_gemm(*quant(h), w2, s2, routing, 1, out_dtype=x.dtype), wts[rows], shared[rows])

    assert torch.equal(bits(pipeline(every[:8], quantize_act)), bits(first8))
    assert not torch.equal(bits(pipeline(every[:8], per_tensor)[:1]), bits(pipeline(every[:1], per_tensor)))


@pytest.mark.usefixtures("ordered_dot")
def test_fp8_moe_prefill_routing(device, monkeypatch):
    """From 65 pairs an expert moe.align picks 128-row routing blocks; fp8_fused_moe caps them at
    ROUTE_BLOCK_MAX (64) and runs PREFILL_TILE (weight tiles by TMA on SM90 and in the
    interpreter). 88 tokens (the 22 four times) give each copy the 22 tokens' bits, and the same
    bits as 128-row routing blocks on the old 128 x 128 tiles."""
    from bi_core.kernels import fp8_moe
    from bi_core.kernels.moe import align

    x, shared, wts, ids, w13, s13, w2, s2 = _moe_inputs(device)
    run = lambda reps: fp8_moe.fp8_fused_moe(x.repeat(reps, 1), wts.repeat(reps, 1), ids.repeat(reps, 1), w13, s13,
                                             w2, s2, shared.repeat(reps))
    blocks = []  # the routing of each call
    monkeypatch.setattr(fp8_moe, "align", lambda *a, **kw: blocks.append(align(*a, **kw)) or blocks[-1])
    assert align(ids.repeat(4, 1), MOE_E + 1, shared=True).block_m == 128  # 264 pairs, 4 experts
    assert fp8_moe.grouped_config(fp8_moe.ROUTE_BLOCK_MAX) == fp8_moe.PREFILL_TILE and fp8_moe.PREFILL_TILE["TMA"]
    ref = bits(run(1))
    assert torch.equal(bits(run(4)), ref.repeat(4, 1)) and blocks[-1].block_m == fp8_moe.ROUTE_BLOCK_MAX == 64
    monkeypatch.setattr(fp8_moe, "ROUTE_BLOCK_MAX", 128)  # the routing before the cap, on its own tile
    assert torch.equal(bits(run(4)), ref.repeat(4, 1)) and blocks[-1].block_m == 128
    assert fp8_moe.grouped_config(128) == {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "SWAP": False}


# ------------------------------------------------------------------------------ GPU only

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="the hardware's side: needs a CUDA GPU")
GPU_SHAPES = [(2048, 2048), (4096, 2048), (2048, 512), (512, 2048), (12352, 2048)]  # SPLIT_K 4, 2, 1, 4, 1
GPU_SIZES = (1, 2, 3, 7, 8, 16, 63, 64, 65, 255, 256, 257, 1024)


@gpu_only
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_rows_invariant_model_shapes(n, k):
    """On the GPU, at the model's shapes: each row of fp8_linear (fp32 in and out, where order
    changes show) is bitwise the same at M = 1..1024 (swapped dots up to 16 rows, not beyond),
    permuted, and under every bucket's launch
    shape forced on the whole batch (wgmma with 64 x 32 .. 128 x 128 tiles, 4 or 8 warps, split
    programs or INLINE); bf16 at a few sizes. Negative control: the
    same rows with another split count differ."""
    from bi_core.kernels.fp8 import fp8_config, fp8_linear, split_k_for

    wq, ws = _weights(n, k, "cuda")
    x = torch.randn(1024, k, device="cuda") * torch.exp2(torch.randint(-4, 4, (1024, 1), device="cuda").float())
    ref = fp8_linear(x, wq, ws)
    bad = [m for m in GPU_SIZES if not torch.equal(bits(fp8_linear(x[:m], wq, ws)), bits(ref[:m]))]
    perm = torch.randperm(1024, device="cuda")
    assert torch.equal(bits(fp8_linear(x[perm], wq, ws)), bits(ref[perm]))
    split = split_k_for(n, k)
    variants = [fp8_config(m, n, k) for m in (1, 100, 1024)]
    variants += [{**v, "INLINE": inline} for v in variants[:1] + variants[2:] for inline in (False, True)]
    variants += [{**variants[2], "BLOCK_M": 64, "BLOCK_N": bn, "num_warps": w} for bn in (64, 128) for w in (4, 8)]
    bad += [v for v in variants if not torch.equal(bits(fp8_linear(x, wq, ws, config=v)), bits(ref))]
    assert bad == []
    xb = x.to(torch.bfloat16)
    ref_b = fp8_linear(xb, wq, ws)
    assert all(torch.equal(bits(fp8_linear(xb[:m], wq, ws)), bits(ref_b[:m])) for m in (1, 8, 65, 257))
    other = 1 if split > 1 else 2
    assert not torch.equal(fp8_linear(x, wq, ws, config={**fp8_config(1024, n, k), "SPLIT_K": other}), ref)


@gpu_only
def test_gpu_same_bits_as_the_vllm_order():
    """On the GPU, fp8_gemm (SPLIT_K 1) gives the bits of a plain kernel written the way vLLM's and
    SGLang's Triton block-FP8 GEMM is (``acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]``, left
    to Triton's default fp fusion), and a kernel in DeepGEMM's order (``(a_s * b_s) * dot``) does
    not: so the explicit fma is what the fusion makes of their expression, and the check can fail."""
    import triton
    import triton.language as tl

    from bi_core.kernels.fp8 import fp8_config, fp8_gemm, quantize_act

    @triton.jit
    def plain(A, AS, B, BS, C, M, N, K, KB, SCALES_FIRST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rk = tl.arange(0, 128)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, KB):
            a = tl.load(A + rm[:, None] * K + kb * 128 + rk[None, :], mask=(rm[:, None] < M), other=0.0)
            b = tl.load(B + rn[None, :] * K + kb * 128 + rk[:, None], mask=(rn[None, :] < N), other=0.0)
            a_s = tl.load(AS + rm * KB + kb, mask=rm < M, other=0.0)
            b_s = tl.load(BS + (rn // 128) * KB + kb, mask=rn < N, other=0.0)
            if SCALES_FIRST:
                acc += (a_s[:, None] * b_s[None, :]) * tl.dot(a, b)
            else:
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        tl.store(C + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

    m, n, k = 256, 2048, 2048
    wq, ws = _weights(n, k, "cuda")
    xq, xs = quantize_act(torch.randn(m, k, device="cuda"))
    ours = fp8_gemm(xq, xs, wq, ws, torch.float32, config={**fp8_config(m, n, k), "SPLIT_K": 1})
    outs = []
    for scales_first in (False, True):
        y = torch.empty(m, n, device="cuda")
        plain[(m // 64, n // 128)](xq, xs, wq, ws, y, m, n, k, k // 128, SCALES_FIRST=scales_first, BM=64, BN=128)
        outs.append(y)
    assert torch.equal(bits(ours), bits(outs[0]))
    assert not torch.equal(bits(ours), bits(outs[1]))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_moe_rows_invariant_model_shapes(dtype):
    """On the GPU, at the 35B-A3B's expert shapes (64 of its 256 experts, top-8, H 2048, I 512, plus
    the shared expert; fp32 activations so order changes show, and bf16, the engine's, where every
    rounding to the model dtype counts: a per-token down kernel passed fp32 and gave other bits in
    bf16, benchmarks section 35): a token's output is bitwise the same alone, in batches of 2..1024
    tokens (up to 8 per pair, then routing blocks of 16 to 64 rows: from 300 tokens 64-row blocks on
    fp8_moe.PREFILL_TILE, whose weight tiles come by TMA), permuted, and with either
    path forced on the same 8 tokens."""
    from bi_core.kernels.fp8_moe import fp8_fused_moe

    e, top, h, i, t = 64, 8, 2048, 512, 1024
    w13 = [quantize_weight(torch.randn(2 * i, h, device="cuda") / h**0.5) for _ in range(e + 1)]
    w2 = [quantize_weight(torch.randn(h, i, device="cuda") / i**0.5) for _ in range(e + 1)]
    w13q, w13s = torch.stack([w[0] for w in w13]), torch.stack([w[1] for w in w13])
    w2q, w2s = torch.stack([w[0] for w in w2]), torch.stack([w[1] for w in w2])
    x = torch.randn(t, h, device="cuda", dtype=dtype)
    wts, ids = torch.rand(t, top, device="cuda").softmax(-1), torch.rand(t, e, device="cuda").topk(top, -1).indices
    shared = torch.randn(t, device="cuda", dtype=dtype)
    run = lambda rows: fp8_fused_moe(x[rows], wts[rows], ids[rows], w13q, w13s, w2q, w2s, shared[rows])
    every = torch.arange(t, device="cuda")
    ref = bits(run(every))
    assert [m for m in (1, 2, 8, 64, 300, 512) if not torch.equal(bits(run(every[:m])), ref[:m])] == []
    perm = torch.randperm(t, device="cuda")
    assert torch.equal(bits(run(perm)), ref[perm])
    forced = lambda rows, p: fp8_fused_moe(x[rows], wts[rows], ids[rows], w13q, w13s, w2q, w2s, shared[rows], per_pair=p)
    assert torch.equal(bits(forced(perm[:8], True)), ref[perm[:8]])
    assert torch.equal(bits(forced(perm[:8], False)), ref[perm[:8]])
