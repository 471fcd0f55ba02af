"""A prompt's images and videos: placeholder expansion, M-RoPE positions, the rows their
embeddings fill, and the prefix-cache key of each vision token (its image's content hash).

Positions follow transformers' ``Qwen3_5Model.get_rope_index`` for one sequence: text tokens
count on from the last position on all three axes; an image of ``h x w`` merged patches at
position ``s`` gives its tokens (t: ``s``, h: ``s + row``, w: ``s + col``) and moves the next
position on by ``max(h, w)``; a video is its frames one after another, each like an image. A
text-only prompt has none of this (its steps keep the plain positions)."""

from __future__ import annotations

import hashlib

import attrs
import torch

from bi_core.errors import RequestError

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # what Qwen's chat template writes for an image
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
FRAME_FPS = 2.0  # a video given as frames is taken at qwen-vl-utils' default sampling rate for frame lists


def _timestamps(num_frames: int, merge: int = 2) -> list[float]:
    """The Qwen3-VL processor's timestamp of each group of ``merge`` frames (their mean time)."""
    times = [i / FRAME_FPS for i in range(num_frames)]
    times += [times[-1]] * (-len(times) % merge)
    return [(times[i] + times[i + merge - 1]) / 2 for i in range(0, len(times), merge)]


def video_text(num_frames: int) -> str:
    """A video's prompt text as the Qwen3-VL processor writes it: a timestamp, then the frame group's placeholder."""
    return "".join(f"<{t:.1f} seconds>{VIDEO_PLACEHOLDER}" for t in _timestamps(num_frames))


@attrs.frozen(kw_only=True)
class VisionItem:
    """One image or video as the processor gave it: ``pixels`` ``[t*h*w, C*T*P*P]`` (CPU) and its
    patch grid ``(t, h, w)`` (before the 2x2 merge)."""

    kind: str  # "image" | "video"
    pixels: torch.Tensor
    grid: tuple[int, int, int]
    digest: str  # sha256 of the grid, dtype and pixel bytes

    @classmethod
    def of(cls, kind: str, pixels: torch.Tensor, grid: tuple[int, int, int]) -> VisionItem:
        pixels = pixels.detach().to("cpu").contiguous()
        h = hashlib.sha256(f"{kind}:{grid}:{pixels.dtype}:{tuple(pixels.shape)}".encode())
        h.update(pixels.view(torch.uint8).numpy().tobytes())
        return cls(kind=kind, pixels=pixels, grid=tuple(int(x) for x in grid), digest=h.hexdigest())

    def num_tokens(self, merge: int) -> int:
        t, h, w = self.grid
        return t * h * w // (merge * merge)


@attrs.define(eq=False)
class MultimodalPrompt:
    """What a sequence with images carries: its items, the M-RoPE positions of its prompt
    (``rope[axis][p]``; past the prompt, token ``p`` is at ``p + delta`` on every axis), the
    embedding row each prompt token takes (-1: its token embedding), the prompt's prefix-cache
    key ids, and the tower's output once computed (``embeds``, once per request; ``parts``: the
    items encoded so far, one tower call each, between steps)."""

    items: list[VisionItem]
    rope: list[list[int]]
    delta: int
    embed_index: list[int]
    key_ids: list
    embeds: torch.Tensor | None = None
    parts: list = attrs.field(factory=list)  # the rows of the items encoded so far, until all are

    def next_tokens(self, merge_unit: int) -> int:
        """Vision tokens of the next item to encode."""
        return self.items[len(self.parts)].pixels.shape[0] // merge_unit

    def positions(self, start: int, end: int) -> tuple[list[int], list[int], list[int]]:
        """The (t, h, w) positions of tokens ``start..end``."""
        n = len(self.embed_index)
        out = []
        for axis in self.rope:
            row = axis[start:min(end, n)]
            out.append(row + list(range(max(start, n) + self.delta, end + self.delta)))
        return out[0], out[1], out[2]


@attrs.frozen(kw_only=True)
class VisionTokens:
    """The placeholder ids of a checkpoint (``config.json``'s top level)."""

    image: int
    video: int
    merge: int  # spatial_merge_size


def _units(items: list[VisionItem], kind: str, merge: int) -> list[tuple[int, int]]:
    """(item number, tokens) of each placeholder run ``kind`` needs: one per image, one per video
    frame (the processor writes a video frame by frame, a timestamp before each)."""
    units = []
    for n, x in enumerate(i for i in items if i.kind == kind):
        t, h, w = x.grid
        units += [(n, h * w // (merge * merge))] * (t if kind == "video" else 1)
    return units


def expand(ids: list[int], items: list[VisionItem], tokens: VisionTokens) -> list[int]:
    """``ids`` with each image's run of placeholder ids (each video frame's) as long as its token
    count: a run of one id is expanded, a run of exactly the count is kept; runs and items pair in
    order, kind by kind."""
    units = {k: _units(items, k, tokens.merge) for k in ("image", "video")}
    taken = {"image": 0, "video": 0}
    out, i = [], 0
    while i < len(ids):
        kind = "image" if ids[i] == tokens.image else "video" if ids[i] == tokens.video else None
        if kind is None:
            out.append(ids[i])
            i += 1
            continue
        j = i
        while j < len(ids) and ids[j] == ids[i]:
            j += 1
        what = "image" if kind == "image" else "video frame"
        if taken[kind] >= len(units[kind]):
            raise RequestError(f"the prompt has more {what} placeholders than the {len(units[kind])} {what}s given")
        n, want = units[kind][taken[kind]]
        if j - i not in (1, want):
            raise RequestError(f"{kind} {n}: a placeholder run has {j - i} tokens; give one placeholder token "
                               f"(expanded here) or exactly {want}, the {what}'s token count")
        out += [ids[i]] * want
        taken[kind] += 1
        i = j
    for kind, u in units.items():
        if taken[kind] != len(u):
            what = "image" if kind == "image" else "video frame"
            raise RequestError(f"{len(u)} {what}s given but the prompt has {taken[kind]} {what} placeholders")
    return out


def build(ids: list[int], items: list[VisionItem], tokens: VisionTokens) -> tuple[list[int], MultimodalPrompt]:
    """The expanded prompt and its MultimodalPrompt (positions as ``get_rope_index`` computes them)."""
    ids = expand(ids, items, tokens)
    rope: list[list[int]] = [[], [], []]
    embed_index, key_ids = [], []
    order = [x for x in items if x.kind == "image"], [x for x in items if x.kind == "video"]
    # videos go frame by frame (transformers splits video grids per frame)
    frames = iter([(x, f) for x in order[1] for f in range(x.grid[0])])
    images = iter(order[0])
    pos = row = i = 0
    merge = tokens.merge
    while i < len(ids):
        if ids[i] not in (tokens.image, tokens.video):
            for axis in rope:
                axis.append(pos)
            embed_index.append(-1)
            key_ids.append(ids[i])
            pos += 1
            i += 1
            continue
        item, frame = (next(images), 0) if ids[i] == tokens.image else next(frames)
        _, h, w = item.grid
        gh, gw = h // merge, w // merge
        for r in range(gh):
            for c in range(gw):
                rope[0].append(pos)
                rope[1].append(pos + r)
                rope[2].append(pos + c)
                embed_index.append(row)
                # the content hash, the frame and the token's place: two different images never share a key
                key_ids.append(("vision", item.digest, frame, r, c))
                row += 1
        pos += max(gh, gw)
        i += gh * gw
    return ids, MultimodalPrompt(items=items, rope=rope, delta=pos - len(ids), embed_index=embed_index,
                                 key_ids=key_ids)


def mrope_axes(section: tuple[int, ...], interleaved: bool, num_freqs: int) -> list[int]:
    """The position axis (0 t, 1 h, 2 w) each rotary frequency ``j`` reads: interleaved (Qwen3.5)
    t, h, w, t, h, w... for the first ``3 * section[1]`` (h) and ``3 * section[2]`` (w) entries,
    t elsewhere (transformers' ``recomposition_frequencies``); else blocks of the sections' sizes."""
    if interleaved:
        axes = [0] * num_freqs
        for axis, offset in ((1, 1), (2, 2)):
            for j in range(offset, min(section[axis] * 3, num_freqs), 3):
                axes[j] = axis
        return axes
    axes = [a for a, n in enumerate(section) for _ in range(n)]
    return (axes + [0] * num_freqs)[:num_freqs]


def encode_next(tower, m: MultimodalPrompt, device: torch.device) -> int:
    """The tower over the next item of ``m`` not encoded yet, alone (one call per image or video:
    its rows never depend on what else is encoded or when, on any backend); once every item is,
    ``m.embeds`` is their rows in order (computed once per request, kept through preemption).
    Returns the item's vision tokens."""
    if tower is None:
        raise RequestError("this engine has no vision tower (model.vision.enabled is false)")
    x = m.items[len(m.parts)]
    with torch.inference_mode():
        m.parts.append(tower(x.pixels.to(device), [x.grid]))
    if len(m.parts) == len(m.items):
        m.embeds = m.parts[0] if len(m.parts) == 1 else torch.cat(m.parts)
        m.parts = []
    return x.pixels.shape[0] // tower.args.merge_unit


def encode(tower, prompts: list[MultimodalPrompt | None], device: torch.device) -> None:
    """Every item of ``prompts`` not encoded yet (``encode_next``), whatever the budget: a step
    about to pack one of them (the scheduler admits a prompt once its images are encoded, so
    normally none is left: ``runtime/vision_encode.py``)."""
    for m in prompts:
        while m is not None and m.embeds is None:
            encode_next(tower, m, device)
