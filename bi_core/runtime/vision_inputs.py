"""A request's images and videos as the vision tower takes them: through transformers' own Qwen3.5
image processor (resize to multiples of 32 pixels within its pixel bounds, normalise, patch) and
video processor (frames: a list of images), or given preprocessed (``pixel_values`` with their
``grid_thw``); the request's limits (``vision.*``) checked; the prompt's placeholders expanded and
its M-RoPE positions computed (``runtime/multimodal.py``)."""

from __future__ import annotations

import io
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bi_core.config import VisionConfig
from bi_core.errors import RequestError
from bi_core.models.vision_tower import VisionArgs
from bi_core.runtime.multimodal import (
    IMAGE_PLACEHOLDER,
    MultimodalPrompt,
    VisionItem,
    VisionTokens,
    build,
    video_text,
)


def _image_processor(path: str | None, args: VisionArgs):
    """The checkpoint's image processor (its preprocessor_config.json), or transformers' Qwen2-VL
    processor (Qwen3.5's) at the tower's patch sizes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    sizes = dict(patch_size=args.patch_size, temporal_patch_size=args.temporal_patch_size,
                 merge_size=args.spatial_merge_size)
    if path is not None and (Path(path) / "preprocessor_config.json").is_file():
        import json

        cfg = json.loads((Path(path) / "preprocessor_config.json").read_text())
        keep = {k: cfg[k] for k in ("size", "image_mean", "image_std", "min_pixels", "max_pixels") if k in cfg}
        return Qwen2VLImageProcessorPil(**keep, **sizes)
    return Qwen2VLImageProcessorPil(**sizes)


def _video_processor(path: str | None, args: VisionArgs):
    try:
        from transformers import Qwen3VLVideoProcessor

        return Qwen3VLVideoProcessor(patch_size=args.patch_size, temporal_patch_size=args.temporal_patch_size,
                                     merge_size=args.spatial_merge_size)
    except ImportError as e:
        raise RequestError(f"videos given as frames need transformers' Qwen3-VL video processor, which needs "
                           f"torchvision ({e}); give the video preprocessed (pixel_values and grid_thw)") from None


def as_image(x: Any):
    """A PIL image, a numpy array (H, W, C) or a torch tensor (C, H, W), or encoded bytes (PNG,
    JPEG, ...), as what the processor takes."""
    from PIL import Image

    if isinstance(x, (bytes, bytearray)):
        try:
            img = Image.open(io.BytesIO(x))
            img.load()
        except Exception as e:  # PIL raises many kinds for bad data
            raise RequestError(f"an image cannot be decoded: {e}") from None
        return img.convert("RGB")
    if isinstance(x, Image.Image):
        return x.convert("RGB")
    if isinstance(x, np.ndarray) and x.ndim == 3:
        return x
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        return x.detach().cpu().numpy().transpose(1, 2, 0)
    raise RequestError(f"an image must be a PIL image, an array (H, W, C), a tensor (C, H, W), encoded bytes or "
                       f"preprocessed {{'pixel_values', 'grid_thw'}}; got {type(x).__name__}")


def _preprocessed(x: dict, kind: str, args: VisionArgs) -> VisionItem:
    if set(x) != {"pixel_values", "grid_thw"}:
        raise RequestError(f"a preprocessed {kind} has exactly the keys pixel_values and grid_thw, got {sorted(x)}")
    pixels, grid = torch.as_tensor(x["pixel_values"]), tuple(int(g) for g in torch.as_tensor(x["grid_thw"]).flatten())
    if len(grid) != 3 or min(grid) < 1 or grid[1] % args.spatial_merge_size or grid[2] % args.spatial_merge_size:
        raise RequestError(f"{kind} grid_thw {grid}: three positive sizes (t, h, w), h and w multiples of "
                           f"{args.spatial_merge_size}")
    if kind == "image" and grid[0] != 1:
        raise RequestError(f"an image's grid_thw has t = 1, not {grid[0]} (a video is given as a video)")
    if tuple(pixels.shape) != (grid[0] * grid[1] * grid[2], args.patch_dim):
        raise RequestError(f"{kind} pixel_values has shape {tuple(pixels.shape)}; grid_thw {grid} needs "
                           f"({grid[0] * grid[1] * grid[2]}, {args.patch_dim})")
    return VisionItem.of(kind, pixels.float(), grid)


class VisionInputs:
    """Turns a request's images and videos into VisionItems and its prompt into the expanded one."""

    def __init__(self, args: VisionArgs, config: VisionConfig, path: str | None) -> None:
        self.args, self.config, self.path = args, config, path
        self.tokens = VisionTokens(image=args.image_token_id, video=args.video_token_id,
                                   merge=args.spatial_merge_size)
        self._images = self._videos = None

    def image(self, x: Any) -> VisionItem:
        if isinstance(x, dict):
            return _preprocessed(x, "image", self.args)
        if self._images is None:
            self._images = _image_processor(self.path, self.args)
        out = self._images(images=[as_image(x)], return_tensors="pt")
        return VisionItem.of("image", out["pixel_values"].float(), tuple(out["image_grid_thw"][0].tolist()))

    def video(self, x: Any) -> VisionItem:
        if isinstance(x, dict):
            return _preprocessed(x, "video", self.args)
        if not isinstance(x, Seq) or isinstance(x, (str, bytes)) or not x:
            raise RequestError("a video is a non-empty list of frames (images), or preprocessed "
                               "{'pixel_values', 'grid_thw'}")
        if self._videos is None:
            self._videos = _video_processor(self.path, self.args)
        frames = np.stack([np.asarray(as_image(f)) for f in x])
        out = self._videos(videos=[frames], return_tensors="pt", do_sample_frames=False)
        return VisionItem.of("video", out["pixel_values_videos"].float(), tuple(out["video_grid_thw"][0].tolist()))

    def check(self, items: list[VisionItem]) -> None:
        """The request's limits (``vision.*``), each refusal naming its key."""
        c, p = self.config, self.args.patch_size
        if len(items) > c.max_images_per_request:
            raise RequestError(f"{len(items)} images and videos; vision.max_images_per_request is "
                               f"{c.max_images_per_request}")
        pixels = sum(x.grid[0] * x.grid[1] * x.grid[2] * p * p * (self.args.temporal_patch_size
                                                                   if x.kind == "video" else 1) for x in items)
        if pixels > c.max_pixels_per_request:
            raise RequestError(f"the images and video frames have {pixels} pixels after resizing; "
                               f"vision.max_pixels_per_request is {c.max_pixels_per_request}")
        tokens = sum(x.num_tokens(self.args.spatial_merge_size) for x in items)
        if tokens > c.max_vision_tokens_per_request:
            raise RequestError(f"the images and videos take {tokens} vision tokens; "
                               f"vision.max_vision_tokens_per_request is {c.max_vision_tokens_per_request}")

    def prepare(self, ids: list[int], images: Seq | None, videos: Seq | None) -> tuple[list[int], MultimodalPrompt]:
        """The prompt with its placeholders expanded, and its MultimodalPrompt."""
        n = len(images or ()) + len(videos or ())
        if n > self.config.max_images_per_request:  # before any decoding work
            raise RequestError(f"{n} images and videos; vision.max_images_per_request is "
                               f"{self.config.max_images_per_request}")
        items = [self.image(x) for x in images or ()] + [self.video(x) for x in videos or ()]
        self.check(items)
        return build(ids, items, self.tokens)


def _random_args(config, text) -> VisionArgs:
    """A random model's tower (``vision.enabled: true``): the published shape at
    ``vision.random_depth`` blocks, placeholder ids inside the vocabulary."""
    from bi_core.errors import ConfigError

    args = VisionArgs.published(text.hidden_size, config.vision.random_depth)
    if args.vision_end_token_id >= text.vocab_size or args.image_token_id >= text.vocab_size:
        raise ConfigError("vision.enabled", f"true on a random model of vocabulary {text.vocab_size}: the image "
                          f"placeholder ids ({args.image_token_id}...) need a real-shape preset (vocabulary 248320)")
    return args


def build_vision(config, factory, world: int, text, device=None):
    """The vision tower (weights loaded, or random for a random model) and the request side, or
    (None, None): ``vision.enabled`` auto takes the checkpoint's tower where it has one and the
    engine runs on one rank; true requires one rank, and a tower or a real-shape random model.
    ``text``: the text model's ModelArgs; ``device``: where its parameters go (default the factory's;
    ``explain`` builds it on the meta device)."""
    from bi_core.errors import ConfigError
    from bi_core.models.loader import read_config
    from bi_core.models.vision_tower import VisionTower, init_random_vision
    from bi_core.models.vision_weights import load_vision_weights

    want = config.vision.enabled
    if want is False:
        return None, None
    random = config.model.random is not None
    if random:
        args = _random_args(config, text) if want is True else None
    else:
        args = VisionArgs.from_hf_config(read_config(config.model.path))
    if args is None or world > 1:
        if want is True:
            why = ("the checkpoint has no vision tower (config.json has no vision_config)" if args is None
                   else f"the vision tower runs on one rank; parallel.tensor_parallel_size is {world}")
            raise ConfigError("vision.enabled", f"true, but {why}")
        return None, None
    base = factory.base
    tower = VisionTower(args, factory, base["dtype"], base["device"] if device is None else device)
    if random and not factory.plan_only:
        init_random_vision(tower, config.model.random.seed)
    elif not factory.plan_only:
        load_vision_weights(tower, config.model.path)
    tower.eval()
    return tower, VisionInputs(args, config.vision, config.model.path)


def per_prompt(media, one: bool, num_prompts: int, name: str) -> list:
    """``generate``'s ``images`` / ``videos`` as one list (or None) per prompt."""
    if media is None:
        return [None] * num_prompts
    if not isinstance(media, (list, tuple)):
        raise RequestError(f"{name} must be a list ({'the prompt' if one else 'one per prompt'}'s), got "
                           f"{type(media).__name__}")
    if one:
        return [list(media)]
    if len(media) != num_prompts:
        raise RequestError(f"{num_prompts} prompts but {len(media)} entries in {name} (one list, or None, per prompt)")
    return [None if m is None else list(m) for m in media]


def conversation(messages: Seq[dict]) -> tuple[list[dict], list, list]:
    """A chat conversation whose contents may be lists of parts: text ``{"type": "text", "text"}``,
    an image ``{"type": "image", "image": ...}`` (anything ``images`` takes), a video
    ``{"type": "video", "video": [frame, ...]}``; as template messages (each image or video part
    its placeholder text, as Qwen's template and processor write it) and the images and videos in order."""
    out, images, videos = [], [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise RequestError(f"messages[{i}] must be a dict with role and content")
        content = m["content"]
        if isinstance(content, list):
            text = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    text.append(part["text"])
                elif kind == "image" and "image" in part:
                    images.append(part["image"])
                    text.append(IMAGE_PLACEHOLDER)
                elif kind == "video" and isinstance(part.get("video"), (list, dict)):
                    videos.append(part["video"])
                    frames = part["video"]["grid_thw"][0] * 2 if isinstance(part["video"], dict) else len(part["video"])
                    text.append(video_text(frames))
                else:
                    raise RequestError(f"messages[{i}].content[{j}]: a part is {{'type': 'text', 'text'}}, "
                                       "{'type': 'image', 'image'} or {'type': 'video', 'video': [frames]}")
            content = "".join(text)
        out.append({**m, "content": content})
    return out, images, videos
