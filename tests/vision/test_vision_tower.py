"""The vision tower (reference backend, float32) against transformers' own
Qwen3_5ForConditionalGeneration on tiny random checkpoints: image embeddings of several image
sizes and a video, loaded from the official multimodal layout."""

from __future__ import annotations

import pytest
import torch
from vl_fixtures import make_hf_vl_model, random_pixels

from bi_core.errors import CheckpointError
from bi_core.models.loader import read_config
from bi_core.models.vision_tower import VisionArgs, VisionTower
from bi_core.models.vision_weights import load_vision_weights
from bi_core.plugins import load_registry
from bi_core.policies import make_policy
from bi_core.selector import OpFactory


def reference_factory() -> OpFactory:
    policy = make_policy(batch_invariant=False, backend="reference", op_overrides={})
    return OpFactory(load_registry(), policy, torch.device("cpu"), torch.float32)


def tower_from(path) -> VisionTower:
    args = VisionArgs.from_hf_config(read_config(path))
    tower = VisionTower(args, reference_factory(), torch.float32, torch.device("cpu"))
    load_vision_weights(tower, path)
    return tower


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_vl_model()
    path = tmp_path_factory.mktemp("vl") / "ckpt"
    hf.save_pretrained(path)
    return hf, path


GRIDS = [
    pytest.param([(1, 4, 4)], id="one-16-patches"),
    pytest.param([(1, 6, 10)], id="wide"),
    pytest.param([(1, 8, 4), (1, 2, 2), (1, 4, 6)], id="three-images"),
    pytest.param([(3, 4, 6)], id="video-3-frames"),
]


@pytest.mark.parametrize("grids", GRIDS)
def test_embeddings_match_transformers(checkpoint, grids):
    hf, path = checkpoint
    tower = tower_from(path)
    pixels = random_pixels(grids, hf)
    with torch.no_grad():
        ours = tower(pixels, grids)
        theirs = torch.cat(hf.model.get_image_features(pixels, torch.tensor(grids), return_dict=True).pooler_output)
    assert ours.shape == theirs.shape == (sum(t * h * w for t, h, w in grids) // 4, hf.config.text_config.hidden_size)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_config_args(checkpoint):
    _, path = checkpoint
    args = VisionArgs.from_hf_config(read_config(path))
    assert (args.depth, args.hidden_size, args.num_heads, args.patch_size, args.image_token_id) == (2, 32, 2, 4, 290)
    assert VisionArgs.from_hf_config({"text_config": {}}) is None


def test_missing_tensor_is_named(checkpoint, tmp_path):
    hf, _ = checkpoint
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if "merger.linear_fc2.bias" not in k}
    save_file(sd, str(tmp_path / "model.safetensors"))
    args = VisionArgs.from_hf_config(hf.config.to_dict())
    tower = VisionTower(args, reference_factory(), torch.float32, torch.device("cpu"))
    with pytest.raises(CheckpointError, match="model.visual.merger.linear_fc2.bias is missing"):
        load_vision_weights(tower, tmp_path)
