"""M-RoPE positions: the frequency layout and the positions of image, video and text tokens as
transformers computes them, and text positions bitwise unchanged (the 1-D path's bits)."""

from __future__ import annotations

import torch
from vl_fixtures import IDS, make_hf_vl_model

from bi_core.backends.reference.attention import Rope
from bi_core.runtime.batch import plan_batch
from bi_core.runtime.multimodal import VisionItem, VisionTokens, build, mrope_axes

IMG, VID = IDS["image_token_id"], IDS["video_token_id"]
TOKENS = VisionTokens(image=IMG, video=VID, merge=2)


def test_axes_match_transformers_interleave():
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    for section, half in (((11, 11, 10), 32), ((2, 1, 1), 4)):
        layout = torch.stack([torch.full((1, 1, half), float(a)) for a in range(3)])  # freq[axis] = axis
        rope = Qwen3_5TextRotaryEmbedding.__new__(Qwen3_5TextRotaryEmbedding)
        rope.mrope_section = list(section)
        theirs = rope.recomposition_frequencies(layout)[0, 0, :half].long().tolist()
        assert mrope_axes(section, True, half) == theirs


def item(kind, grid):
    t, h, w = grid
    return VisionItem.of(kind, torch.randn(t * h * w, 8), grid)


def test_positions_match_get_rope_index():
    hf = make_hf_vl_model()
    items = [item("image", (1, 4, 6)), item("video", (2, 4, 4)), item("image", (1, 2, 2))]
    ids = [1, 2, IMG, 3, 11, VID, 12, VID, 4, IMG, 5, 6]
    full, mm = build(ids, items, TOKENS)
    input_ids = torch.tensor([full])
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == IMG], types[input_ids == VID] = 1, 2
    pos, delta = hf.model.get_rope_index(input_ids, types, image_grid_thw=torch.tensor([[1, 4, 6], [1, 2, 2]]),
                                         video_grid_thw=torch.tensor([[2, 4, 4]]))
    assert mm.rope == pos[:, 0].tolist()
    assert mm.delta == int(delta)
    # past the prompt, every axis counts on from the prompt's last position
    after = mm.positions(len(full), len(full) + 2)
    assert after[0] == after[1] == after[2] == [int(pos.max()) + 1, int(pos.max()) + 2]
    assert [i for i, e in enumerate(mm.embed_index) if e >= 0] == [i for i, t in enumerate(full) if t in (IMG, VID)]


def test_text_only_batch_keeps_plain_positions():
    hb = plan_batch([[1, 2, 3], [4]], [0, 7], [[0], [1]], [0, 1], [False, True], block_size=16)
    assert not hb.is_multimodal and hb.rope_positions is None and hb.positions == [0, 1, 2, 7]
    hb = plan_batch([[1, 2, 3], [4]], [0, 7], [[0], [1]], [0, 1], [False, True], block_size=16, mm=[None, None],
                    mrope_axes=[0, 1, 2, 0])
    assert not hb.is_multimodal


def test_reference_rope_of_equal_axes_is_the_1d_rope():
    rope = Rope(64, 1e7, torch.device("cpu"))
    positions = torch.arange(0, 5000, 7)
    three = positions[:, None].expand(-1, 32).contiguous()
    for dtype in (torch.float32, torch.bfloat16):
        a, b = rope.cos_sin(positions, dtype), rope.cos_sin(positions, dtype, three)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    shifted = three.clone()
    shifted[:, 1::3] += 1  # negative control: the h axis moved
    assert not torch.equal(rope.cos_sin(positions, torch.float32)[0], rope.cos_sin(positions, torch.float32, shifted)[0])


def test_rows_whose_axes_agree_are_a_text_step_at_shifted_positions():
    """Decode and verify rows past an image prompt (and text chunks without vision rows) are 1-D
    positions ``p + delta``, the step not multimodal (graphable); a chunk with vision rows keeps
    M-RoPE."""
    items = [item("image", (1, 4, 6))]
    full, mm = build([1, 2, IMG, 3, 4], items, TOKENS)  # 6 vision tokens over 3 positions: delta -3
    n, axes = len(full), [0, 1, 2, 0]
    assert mm.delta == -3
    mm.embeds = torch.zeros(6, 8)
    decode = plan_batch([[7], [8, 9, 10], [5]], [n + 4, n, 20], [[0], [1], [2, 3]], [0, 1, 2], [True] * 3,
                        block_size=16, mm=[mm, mm, None], mrope_axes=axes)
    assert not decode.is_multimodal
    assert decode.positions == [n + 4 - 3, n - 3, n - 2, n - 1, 20]
    assert decode.slot_mapping == [n + 4, 16 + n, 16 + n + 1, 16 + n + 2, 48 + 4]  # KV slots: the token's index
    before = plan_batch([full[:2]], [0], [[0]], [0], [False], block_size=16, mm=[mm], mrope_axes=axes)
    assert not before.is_multimodal and before.positions == [0, 1]
    with_image = plan_batch([full[:4]], [0], [[0]], [0], [False], block_size=16, mm=[mm], mrope_axes=axes)
    assert with_image.is_multimodal and with_image.rope_positions[1] == [0, 1, 2, 2] and with_image.embed_rows
    # the MTP head's row before the image's first token takes that token's embedding: M-RoPE step
    head = plan_batch([[full[1]]], [1], [[0]], [0], [True], block_size=16, mm=[mm], mrope_axes=axes, embed_shift=1)
    assert head.is_multimodal and head.embed_rows == [0]
