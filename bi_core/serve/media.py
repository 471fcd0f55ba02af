"""Images and videos in HTTP requests, decoded on the HTTP side into arrays the engine's image
processor takes: OpenAI chat content parts (``{"type": "image_url", "image_url": {"url": ...}}``;
a video as Qwen's ``{"type": "video", "video": [frame, ...]}``) and SGLang's ``image_data`` /
``video_data`` in ``/generate``. An image is a ``data:`` URL (base64), a bare base64 string
(SGLang's), or a local file (a ``file://`` URL or a path) inside ``vision.media_root``; nothing
is fetched from the network, and nothing a request carries is unpickled or evaluated."""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from bi_core.runtime.multimodal import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, video_text  # noqa: F401 (re-exported)
from bi_core.serve.api_errors import ApiError

MAX_IMAGE_BYTES = 64 << 20  # one encoded image (a decompression bomb is PIL's MAX_IMAGE_PIXELS' to stop)
_DATA_URL = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,(.*)$", re.DOTALL)
_NETWORK = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _decode_bytes(raw: bytes, param: str) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    if len(raw) > MAX_IMAGE_BYTES:
        raise ApiError(400, f"the image is {len(raw)} bytes; at most {MAX_IMAGE_BYTES}", param=param)
    try:
        img = Image.open(io.BytesIO(raw))
        img.load()
        return np.asarray(img.convert("RGB"))
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ApiError(400, f"the image cannot be decoded: {e}", param=param) from None


def _base64(data: str, param: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "the image is neither a data: URL, base64, nor a local file path", param=param) from None


def _local(path: str, root: str | None, param: str) -> bytes:
    if root is None:
        raise ApiError(400, "local image files are refused: this server has no vision.media_root (send the image as "
                            "a data: URL)", param=param)
    base = Path(root).resolve()
    target = (base / path).resolve() if not os.path.isabs(path) else Path(path).resolve()
    if not target.is_relative_to(base):
        raise ApiError(400, f"the image path is outside vision.media_root ({base})", param=param)
    if not target.is_file():
        raise ApiError(400, f"no image file at {path!r} under vision.media_root", param=param)
    return target.read_bytes()


def decode_image(value: Any, root: str | None, param: str) -> np.ndarray:
    """One image (H, W, 3) uint8 from a ``data:`` URL, base64, or a local file under ``root``."""
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"an image is a non-empty string (data: URL, base64 or a file path), got "
                            f"{type(value).__name__}", param=param)
    match = _DATA_URL.match(value)
    if match:
        return _decode_bytes(_base64(match.group(1), param), param)
    if value.startswith("file://"):
        return _decode_bytes(_local(value[len("file://"):], root, param), param)
    if _NETWORK.match(value) or value.startswith("data:"):
        raise ApiError(400, "images are not fetched from the network: send a data:image/...;base64 URL (or a file "
                            "under vision.media_root)", param=param)
    if value.lower().endswith((".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")):  # a path, as SGLang tells them
        return _decode_bytes(_local(value, root, param), param)
    return _decode_bytes(_base64(value, param), param)


def decode_video(frames: Any, root: str | None, param: str) -> list[np.ndarray]:
    if not isinstance(frames, list) or not frames:
        raise ApiError(400, "a video is a non-empty list of frames (images)", param=param)
    return [decode_image(f, root, f"{param}[{i}]") for i, f in enumerate(frames)]


def part_text(part: dict) -> str:
    """A chat content part as the prompt's text: its text, or the image's (video's) placeholders."""
    kind = part.get("type")
    if kind == "text":
        return part["text"]
    if kind == "image_url":
        return IMAGE_PLACEHOLDER
    return video_text(len(part["video"]))


def check_part(part: Any) -> None:
    """Raises ValueError for a content part of another type or shape (the protocol's validator)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return
    if kind == "image_url" and isinstance(part.get("image_url"), (dict, str)):
        return
    if kind == "video" and isinstance(part.get("video"), list) and part["video"]:
        return
    raise ValueError("content parts are {\"type\": \"text\", \"text\": ...}, {\"type\": \"image_url\", "
                     "\"image_url\": {\"url\": ...}} or {\"type\": \"video\", \"video\": [frame, ...]}")


NO_IMAGES = "this server takes no images: its checkpoint has no vision tower, or vision.enabled is false"


def chat_media(contents: list, root: str | None, takes_images: bool = True) -> tuple[list, list]:
    """The decoded images and videos of a conversation's messages (each message's content), in order."""
    images, videos = [], []
    for m, content in enumerate(contents):
        if not isinstance(content, list):
            continue
        if not takes_images and any(p.get("type") != "text" for p in content):
            raise ApiError(400, NO_IMAGES, param=f"messages[{m}].content")
        for i, part in enumerate(content):
            param = f"messages[{m}].content[{i}]"
            if part.get("type") == "image_url":
                url = part["image_url"]
                url = url.get("url") if isinstance(url, dict) else url
                images.append(decode_image(url, root, f"{param}.image_url.url"))
            elif part.get("type") == "video":
                videos.append(decode_video(part["video"], root, f"{param}.video"))
    return images, videos


def sglang_media(image_data: Any, video_data: Any, num_prompts: int, root: str | None,
                 takes_images: bool = True) -> list[dict]:
    """SGLang's ``image_data`` / ``video_data``: for one prompt an image or a list of them, for a
    batch one entry (an image, a list, or null) per prompt; as ``{"images", "videos"}`` per prompt."""
    out = [{"images": None, "videos": None} for _ in range(num_prompts)]
    for data, key in ((image_data, "images"), (video_data, "videos")):
        if data is None:
            continue
        if not takes_images:
            raise ApiError(400, NO_IMAGES, param=f"{key[:-1]}_data")
        per = [data] if num_prompts == 1 else data
        if num_prompts > 1 and (not isinstance(data, list) or len(data) != num_prompts):
            raise ApiError(400, f"a batch of {num_prompts} prompts takes one {key[:-1]}_data entry per prompt",
                           param=f"{key[:-1]}_data")
        for j, entry in enumerate(per):
            if entry is None:
                continue
            param = f"{key[:-1]}_data" + (f"[{j}]" if num_prompts > 1 else "")
            if key == "images":
                items = entry if isinstance(entry, list) else [entry]
                out[j]["images"] = [decode_image(x, root, f"{param}[{i}]") for i, x in enumerate(items)]
            else:  # a video is a list of frames; several videos a list of those
                videos = entry if entry and isinstance(entry[0], list) else [entry]
                out[j]["videos"] = [decode_video(v, root, f"{param}[{i}]") for i, v in enumerate(videos)]
    return out
