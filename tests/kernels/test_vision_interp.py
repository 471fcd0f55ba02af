"""The vision tower's Triton kernels and the whole tower on them, under Triton's interpreter (or on
the GPU): close to the reference, and an image's results bitwise the same alone or among other
images, wherever it lies in the launch; the negative control (key steps on a grid of the whole
launch) must find a difference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bi_core.backends.reference.vision import eager_image_attention
from bi_core.kernels.vision import layer_norm, vision_attention

pytestmark = pytest.mark.usefixtures("ordered_dot", "poisoned_empty")

DTYPES = [torch.bfloat16, torch.float32]
LENS = [37, 150, 64, 5]  # image lengths laid end to end (150 spans three key steps)


def qkv(n: int, heads: int, dim: int, dtype, device):
    x = torch.randn(n, 3, heads, dim, device=device).to(dtype)
    return x[:, 0], x[:, 1], x[:, 2]  # one strided layout, as the tower's qkv projection gives


def cu(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16, 72])
def test_attention_matches_reference(device, dtype, dim):
    torch.manual_seed(1)
    q, k, v = qkv(sum(LENS), 2, dim, dtype, device)
    got = vision_attention(q, k, v, cu(LENS), dim ** -0.5)
    offsets = cu(LENS)
    for a, b in zip(offsets[:-1], offsets[1:]):
        want = eager_image_attention(q[a:b].float(), k[a:b].float(), v[a:b].float(), dim ** -0.5)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(got[a:b].float(), want, atol=tol, rtol=tol)


def _alone_vs_packed(device, dtype, key_grid):
    torch.manual_seed(2)
    q, k, v = qkv(sum(LENS), 2, 16, dtype, device)
    packed = vision_attention(q, k, v, cu(LENS), 0.25, key_grid)
    offsets, bad = cu(LENS), []
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        alone = vision_attention(q[a:b].contiguous(), k[a:b].contiguous(), v[a:b].contiguous(), [0, b - a], 0.25,
                                 key_grid)
        if not torch.equal(alone, packed[a:b]):
            bad.append(i)
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_image_alone_equals_packed(device, dtype):
    assert _alone_vs_packed(device, dtype, None) == []


def test_attention_negative_control(device):
    """Key steps on the launch's grid: the 150-row image after a 37-row one sums in another order."""
    assert 1 in _alone_vs_packed(device, torch.float32, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_rows(device, dtype):
    torch.manual_seed(3)
    x = torch.randn(40, 72, device=device).to(dtype)
    w, b = torch.randn(72, device=device).to(dtype), torch.randn(72, device=device).to(dtype)
    full = layer_norm(x, w, b, 1e-6)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(full.float(), F.layer_norm(x.float(), (72,), w.float(), b.float(), 1e-6),
                               atol=tol, rtol=tol)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 30)):
        assert torch.equal(layer_norm(x[rows].contiguous(), w, b, 1e-6), full[rows])


TOWER_GRIDS = [(1, 10, 10), (1, 6, 8), (1, 12, 8), (2, 4, 4)]  # 100 + 48 + 96 + 32 patches


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    from vl_fixtures import make_hf_vl_model

    hf = make_hf_vl_model()
    path = tmp_path_factory.mktemp("vl") / "ckpt"
    hf.save_pretrained(path)
    return hf, path


def _tower(path, dtype, device):
    from triton_anywhere import TritonAnywhere

    from bi_core.models.loader import read_config
    from bi_core.models.vision_tower import VisionArgs, VisionTower
    from bi_core.models.vision_weights import load_vision_weights
    from bi_core.plugins import load_registry
    from bi_core.policies import make_policy
    from bi_core.selector import OpFactory

    policy = make_policy(batch_invariant=True, backend="triton_anywhere", op_overrides={})
    factory = OpFactory(load_registry(extra_plugins=(TritonAnywhere(),)), policy, device, dtype)
    tower = VisionTower(VisionArgs.from_hf_config(read_config(path)), factory, dtype, device)
    load_vision_weights(tower, path)
    return tower


def _tower_mismatches(tower, hf) -> list[int]:
    from vl_fixtures import random_pixels

    pixels = random_pixels(TOWER_GRIDS, hf).to(tower.device)
    with torch.no_grad():
        together = tower(pixels, TOWER_GRIDS)
        bad, at, row = [], 0, 0
        order = list(range(len(TOWER_GRIDS)))
        for i in order:
            t, h, w = TOWER_GRIDS[i]
            n = t * h * w
            alone = tower(pixels[at:at + n], [TOWER_GRIDS[i]])
            if not torch.equal(alone, together[row:row + n // 4]):
                bad.append(i)
            at, row = at + n, row + n // 4
        # the last two images first, then the first two: each image's rows still the same
        swapped = TOWER_GRIDS[2:] + TOWER_GRIDS[:2]
        split = sum(t * h * w for t, h, w in TOWER_GRIDS[:2])
        again = tower(torch.cat([pixels[split:], pixels[:split]]), swapped)
        if not torch.equal(torch.cat([again[(pixels.shape[0] - split) // 4:], again[:(pixels.shape[0] - split) // 4]]),
                           together):
            bad.append(-1)
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
def test_tower_image_alone_equals_among_others(vl_checkpoint, device, dtype):
    hf, path = vl_checkpoint
    tower = _tower(path, dtype, device)
    assert _tower_mismatches(tower, hf) == []
    if dtype == torch.float32:  # and it is the model: close to transformers'
        from vl_fixtures import random_pixels

        pixels = random_pixels(TOWER_GRIDS, hf)
        with torch.no_grad():
            want = torch.cat(hf.model.get_image_features(pixels, torch.tensor(TOWER_GRIDS), return_dict=True)
                             .pooler_output)
            got = tower(pixels.to(device), TOWER_GRIDS).cpu()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


def test_tower_negative_control(vl_checkpoint, device, monkeypatch):
    """The same tower with attention's key steps on the launch's grid: some image moves."""
    from bi_core.backends.cuda_common import vision as impls

    hf, path = vl_checkpoint
    tower = _tower(path, torch.float32, device)
    monkeypatch.setattr(impls.TritonVisionAttentionImpl, "forward",
                        lambda self, q, k, v, cu_t, cu_h: vision_attention(q, k, v, cu_h, self.scale, key_grid=64))
    assert _tower_mismatches(tower, hf) != []


@pytest.mark.parametrize("dtype", DTYPES)
def test_mrope_kernel_of_equal_axes_is_the_1d_kernel(device, dtype):
    """A text token in a step with images: the M-RoPE kernel gives the 1-D kernel's bits."""
    from bi_core.kernels.mrope import qk_norm_mrope_write
    from bi_core.kernels.qk_norm_rope import qk_norm_rope_write

    torch.manual_seed(4)
    t, hq, hkv, d, rot = 9, 2, 1, 64, 16
    qkv = torch.randn(t, 2 * hq * d + 2 * hkv * d, device=device).to(dtype)
    qn, kn = (0.1 * torch.randn(d, device=device)).to(dtype), (0.1 * torch.randn(d, device=device)).to(dtype)
    inv = 1.0 / (1e7 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
    pos = torch.arange(100, 100 + 13 * t, 13, device=device)
    slots = torch.arange(t, device=device)

    def run(rope_positions):
        kc = torch.zeros(4, 16, hkv, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        if rope_positions is None:
            return qk_norm_rope_write(qkv, qn, kn, inv, pos, slots, kc, vc, hq, 1e-6, rot), kc
        return qk_norm_mrope_write(qkv, qn, kn, inv, rope_positions, slots, kc, vc, hq, 1e-6, rot), kc

    plain = run(None)
    same = run(pos[:, None].expand(-1, rot // 2).contiguous())
    assert torch.equal(plain[0], same[0]) and torch.equal(plain[1], same[1])
    moved = pos[:, None].expand(-1, rot // 2).contiguous().clone()
    moved[:, 1] += 3  # negative control
    assert not torch.equal(plain[0], run(moved)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_image_requests_decode_rows_on_the_1d_kernel_are_the_mrope_kernels_bits(device, dtype):
    """Decode rows past an image prompt take the 1-D kernel at ``plan_batch``'s shifted positions
    (the graphed path): bitwise the M-RoPE kernel at their (t, h, w) positions; negative control:
    the unshifted index positions."""
    from bi_core.kernels.mrope import qk_norm_mrope_write
    from bi_core.kernels.qk_norm_rope import qk_norm_rope_write
    from bi_core.runtime.batch import plan_batch
    from bi_core.runtime.multimodal import VisionItem, VisionTokens, build, mrope_axes

    torch.manual_seed(5)
    img = 9
    full, mm = build([1, 2, img, 3], [VisionItem.of("image", torch.randn(8 * 12, 4), (1, 8, 12))],
                     VisionTokens(image=img, video=10, merge=2))
    assert mm.delta < 0
    hq, hkv, d, rot = 2, 1, 64, 16
    pasts = [len(full), len(full) + 37, len(full) + 200]
    hb = plan_batch([[5], [6], [7]], pasts, [list(range(20))] * 3, [0, 1, 2], [True] * 3, block_size=16,
                    mm=[mm] * 3, mrope_axes=[0] * 8)
    assert not hb.is_multimodal
    axes = mrope_axes((3, 3, 2), True, rot // 2)
    three = [mm.positions(p, p + 1) for p in pasts]
    mrope = torch.tensor([[three[i][a][0] for a in axes] for i in range(3)], device=device)
    qkv = torch.randn(3, 2 * hq * d + 2 * hkv * d, device=device).to(dtype)
    qn, kn = (0.1 * torch.randn(d, device=device)).to(dtype), (0.1 * torch.randn(d, device=device)).to(dtype)
    inv = 1.0 / (1e7 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=device) / rot))
    slots = torch.arange(3, device=device)

    def run(write, pos):
        kc = torch.zeros(2, 16, hkv, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        return write(qkv, qn, kn, inv, pos, slots, kc, vc, hq, 1e-6, rot), kc

    flat = run(qk_norm_rope_write, torch.tensor(hb.positions, device=device))
    ref = run(qk_norm_mrope_write, mrope)
    assert torch.equal(flat[0], ref[0]) and torch.equal(flat[1], ref[1])
    unshifted = run(qk_norm_rope_write, torch.tensor(pasts, device=device))
    assert not torch.equal(unshifted[0], ref[0])
