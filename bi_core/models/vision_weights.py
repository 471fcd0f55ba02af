"""The vision tower's weights from a checkpoint or an update: ``model.visual.*`` (or ``visual.*``)
tensors of a source (``models/loader.py``'s ``CheckpointIndex`` or ``TensorDict``, which keep them
apart from the text model's), checked whole before any is copied, as the text model's updates are."""

from __future__ import annotations

import logging
import math

import torch

from bi_core.errors import CheckpointError
from bi_core.models.vision_tower import VisionTower, checkpoint_names

log = logging.getLogger(__name__)


def check_vision_update(tower: VisionTower | None, source, *, in_memory: bool,
                        complete: bool = False) -> list[tuple[str, str]]:
    """The (tower parameter, tensor name) copies of ``source``'s vision tensors, after checking
    every name, shape and (``in_memory``) dtype: the tower's or float32, as the text model's
    rule. ``complete``: every tower tensor must be there (a load). Without a tower (a text-only
    engine) they are not loaded, and the log says so."""
    names = list(source.visual)
    if tower is None:
        if names:
            log.info("%d vision tower tensors (model.visual.*) not loaded: this engine runs no vision tower "
                     "(model.vision.enabled: false)", len(names))
        return []
    ours = {theirs: mine for mine, theirs in checkpoint_names(tower.args).items()}
    params = dict(tower.named_parameters())
    dtype = next(iter(params.values())).dtype
    problems = []
    unknown = [n for n in names if n not in ours]
    if unknown:
        problems.append(f"unknown vision tensor names {['model.visual.' + n for n in unknown[:5]]} (expected "
                        "Qwen3.5's, e.g. model.visual.blocks.0.attn.qkv.weight)")
    if complete:
        missing = [n for n in ours if n not in source.visual]
        if missing:
            problems.append(f"tensor model.visual.{missing[0]} is missing from checkpoint {source.path} (the vision "
                            "tower's; a text-only engine needs model.vision.enabled: false)")
    for n in names:
        if n not in ours:
            continue
        shape, p = source.visual_shape(n), params[ours[n]]
        if math.prod(shape) != p.numel() or (len(shape) == p.dim() and shape != tuple(p.shape)):
            problems.append(f"model.visual.{n}: shape {shape}, the config's vision_config gives {tuple(p.shape)}")
        elif in_memory and source.visual[n].dtype not in (dtype, torch.float32):
            problems.append(f"model.visual.{n}: dtype {source.visual[n].dtype}; expected {dtype} or torch.float32")
    if problems:
        raise CheckpointError("; ".join(problems[:5]) + ("" if complete else "; nothing was updated"))
    return [(ours[n], n) for n in names if n in ours]


@torch.no_grad()
def apply_vision_update(tower: VisionTower | None, source, steps: list[tuple[str, str]]) -> int:
    """Copy the checked tensors into the tower (the Conv3d patch weight ``[hidden, C, T, P, P]``
    into the linear's ``[hidden, C*T*P*P]``); returns how many."""
    if not steps:
        return 0
    params = dict(tower.named_parameters())
    for mine, theirs in steps:
        p = params[mine]
        p.copy_(source.get_visual(theirs).reshape(p.shape))
    return len(steps)


def load_vision_weights(tower: VisionTower, path) -> None:
    """Every tower tensor from the checkpoint directory ``path``."""
    from bi_core.models.loader import CheckpointIndex

    source = CheckpointIndex(path)
    apply_vision_update(tower, source, check_vision_update(tower, source, in_memory=False, complete=True))
