"""G1 with images on the Triton backend (the invariant backend's kernels, under the interpreter on
the CPU): an image request alone, and admitted in one step with another image request and text
requests (each image in its own tower call, between steps), gives the same tokens, logprobs and
last-prompt-row logits, bitwise. Negative control: the tower's attention with key steps on the
launch's grid and the step's images encoded in one call, the needle's after the other's (an
image's reduction order then follows where it lies in the call), moves the needle's logits."""

from __future__ import annotations

import pytest
import torch
from triton_anywhere import RERUN_GRAPHS, TritonAnywhere
from vl_fixtures import IDS, make_hf_vl_model, random_pixels

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.plugins import load_registry
from bi_core.runtime.vision_encode import VisionEncoder

IMG, VS, VE = IDS["image_token_id"], IDS["vision_start_token_id"], IDS["vision_end_token_id"]
NEEDLE = [5, 6, VS, IMG, VE, 7, 8, 9]
NEEDLE_GRID = (1, 12, 12)  # 144 patches: three key steps of the tower's attention
OTHER = [11, VS, IMG, VE, 12]
OTHER_GRID = (1, 10, 10)  # 100 patches before the needle's in the tower call


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_vl_model(seed=6)
    path = tmp_path_factory.mktemp("vl") / "ckpt"
    hf.save_pretrained(path)
    return hf, path


def config(path, device):
    return EngineConfig.from_dict({
        "model": {"path": str(path), "dtype": "float32", "device": device.type, "max_model_len": 256},
        "backend": "triton_anywhere", "graph": RERUN_GRAPHS,
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 128, "prefill_chunk_size": 64},
        "cache": {"block_size": 16, "num_blocks": 64, "prefix_caching": False}})


def needle_run(path, device, hf, with_others: bool, per_image: bool = True):
    """(tokens, logprobs, last prompt row's logits) of the needle."""
    eng = build_engine(config(path, device), load_registry(extra_plugins=(TritonAnywhere(),)))
    seen = []
    eng.runner.on_logits = lambda seqs, logits: seen.extend(
        logits[i].clone() for i, s in enumerate(seqs) if s.request_id == needle_id[0] and not s.output_ids)
    hot = SamplingParams(max_new_tokens=3, temperature=0.8, seed=99, ignore_eos=True, logprobs=1)
    needle_img = {"pixel_values": random_pixels([NEEDLE_GRID], hf, seed=1), "grid_thw": NEEDLE_GRID}
    needle_id, calls, forward = [None], [], eng.runner.vision.forward
    eng.runner.vision.forward = lambda pixels, grids: calls.append(list(grids)) or forward(pixels, grids)
    if with_others:
        eng.add_request(OTHER, SamplingParams(max_new_tokens=2, ignore_eos=True),
                        images=[{"pixel_values": random_pixels([OTHER_GRID], hf, seed=2), "grid_thw": OTHER_GRID}])
    n = eng.add_request(NEEDLE, hot, images=[needle_img])
    needle_id[0] = n.request_id
    if with_others:
        eng.add_request([3, 4, 5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    while eng.scheduler.has_work():
        eng.step()
    if per_image:
        assert calls == ([[OTHER_GRID], [NEEDLE_GRID]] if with_others else [[NEEDLE_GRID]])
    else:
        assert calls == [[OTHER_GRID, NEEDLE_GRID]]
    return n.output_ids, n.token_logprobs, n.top_logprobs, seen[0]


@pytest.mark.usefixtures("ordered_dot")
def test_image_request_alone_and_among_others_bitwise(checkpoint, device, monkeypatch):
    hf, path = checkpoint
    alone = needle_run(path, device, hf, False)
    among = needle_run(path, device, hf, True)
    assert among[:3] == alone[:3]
    assert torch.equal(among[3], alone[3])

    from bi_core.backends.cuda_common import vision as impls
    from bi_core.kernels.vision import vision_attention

    monkeypatch.setattr(impls.TritonVisionAttentionImpl, "forward",
                        lambda self, q, k, v, cu_t, cu_h: vision_attention(q, k, v, cu_h, self.scale, key_grid=64))
    assert torch.equal(needle_run(path, device, hf, True)[3], alone[3])  # each image alone: starts at row 0
    monkeypatch.setattr(VisionEncoder, "step", one_call)  # and both images in one call: the needle's rows move
    assert not torch.equal(needle_run(path, device, hf, True, per_image=False)[3], alone[3])


def one_call(self, scheduler) -> int:
    """The queued images of a step in one tower call, laid end to end (before they were encoded
    one call an image)."""
    todo = self.pending(scheduler)
    items = [x for m in todo for x in m.items]
    if not items:
        return 0
    out = self.tower(torch.cat([x.pixels for x in items]).to(self.device), [x.grid for x in items])
    at = 0
    for m in todo:
        n = sum(x.pixels.shape[0] for x in m.items) // self.tower.args.merge_unit
        m.embeds, at = out[at:at + n], at + n
    return len(items)
