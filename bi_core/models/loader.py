"""Loads Hugging Face Qwen3.5 checkpoints (config.json + single or sharded safetensors) into
:class:`Qwen35Model`, fusing projections as the model expects.

Accepted: ``model.language_model.*`` (multimodal) and ``model.*`` (text-only) names; fused
``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` (or transposed), or per-expert
``experts.{e}.{gate,up,down}_proj.weight``, independently for main and MTP layers; ``mtp.*``.
Where each tensor goes is ``weight_map.py``'s; this module reads sources (a checkpoint directory,
or named tensors in memory), checks them, and copies: a full load, or an in-place update.

Block-wise FP8 (``bi_core/quant``): a model's FP8 parameters take FP8 tensors with their
``*_scale_inv`` (from a checkpoint directory), or bf16/fp32 tensors quantized block-wise on the
way in (a bf16 checkpoint under ``model.quantization: fp8``, or an update from a trainer); the
weights stay FP8 in memory (nothing is dequantized at load).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch
from safetensors import safe_open

from bi_core.errors import CheckpointError
from bi_core.models.args import ModelArgs
from bi_core.models.weight_map import ALL, Placement, WeightMap, weight_map
from bi_core.quant import fp8_loading as fp8
from bi_core.quant.fp8_numerics import FP8
from bi_core.quant.params import is_block_scale, is_fp8

log = logging.getLogger(__name__)
VISUAL_PREFIXES = ("model.visual.", "visual.")  # the vision tower's: a source keeps them apart (``visual``)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "conv1d.bias")


def _visual_name(key: str) -> str:
    """A vision tower tensor's name after its prefix (``model.visual.`` or ``visual.``)."""
    return next(key[len(p):] for p in VISUAL_PREFIXES if key.startswith(p))


def read_config(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/config.json cannot be read: {e}") from None


def _normalise(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model."):]
    return name


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                       "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class CheckpointIndex:
    """Normalised tensor name -> (file, stored name), over every ``*.safetensors`` in a directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.path}")
        self.where: dict[str, tuple[Path, str]] = {}
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # shape and dtype, from the headers
        self.visual: dict[str, tuple[Path, str]] = {}  # the vision tower's, by name after model.visual.
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    if key.startswith(VISUAL_PREFIXES):
                        self.visual[_visual_name(key)] = (f, key)
                        continue
                    if key.endswith(IGNORED_SUFFIXES):
                        continue
                    name = _normalise(key)
                    info = st.get_slice(key)
                    self.where[name] = (f, key)
                    self.meta[name] = (tuple(info.get_shape()), _SAFETENSORS_DTYPES.get(info.get_dtype(), torch.uint8))
        self._handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.where

    def has_prefix(self, prefix: str) -> bool:
        return any(k.startswith(prefix) for k in self.where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise CheckpointError(f"tensor {name} is missing from checkpoint {self.path}")
        return self._read(*self.where[name])

    def get_visual(self, name: str) -> torch.Tensor:
        return self._read(*self.visual[name])

    def visual_shape(self, name: str) -> tuple[int, ...]:
        f, key = self.visual[name]
        return tuple(self._handle(f).get_slice(key).get_shape())

    def _read(self, f: Path, key: str) -> torch.Tensor:
        return self._handle(f).get_tensor(key)

    def _handle(self, f: Path):
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        return self._handles[f]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][0]

    def names(self) -> list[str]:
        return list(self.where)

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[name][1]


class TensorDict:
    """Named tensors in memory (a trainer's ``state_dict``, or ``(name, tensor)`` pairs) as a
    source like :class:`CheckpointIndex`: names normalised, the vision tower's kept apart."""

    def __init__(self, tensors, label: str = "the given tensors") -> None:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        self.path = label
        self.tensors: dict[str, torch.Tensor] = {}
        self.visual: dict[str, torch.Tensor] = {}  # by name after model.visual.
        for name, t in items:
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise CheckpointError(f"weights must be (name, tensor) pairs, got ({type(name).__name__}, "
                                      f"{type(t).__name__})")
            if name.startswith(VISUAL_PREFIXES):
                self.visual[_visual_name(name)] = t
            elif not name.endswith(IGNORED_SUFFIXES):
                self.tensors[_normalise(name)] = t

    def get_visual(self, name: str) -> torch.Tensor:
        return self.visual[name]

    def visual_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.visual[name].shape)

    def names(self) -> list[str]:
        return list(self.tensors)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _is_transposed(source, prefix: str, args: ModelArgs) -> bool:
    """Fused experts stored [E, in, out] (Qwen3-VL-MoE) instead of [E, out, in]. Decided from both
    tensors when both are there, since one alone is ambiguous when H == 2I (gate_up) or H == I (down)."""
    e, h, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
    up = source.shape(f"{prefix}.gate_up_proj") if source.has(f"{prefix}.gate_up_proj") else None
    down = source.shape(f"{prefix}.down_proj") if source.has(f"{prefix}.down_proj") else None
    return (up == (e, h, 2 * i) and up != (e, 2 * i, h)) or (down == (e, i, h) and down != (e, h, i))


def _fits(have: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Equal, or equal but for size-1 dims (conv1d ``[C, 1, K]`` for ``[C, K]``)."""
    return have == want or (math.prod(have) == math.prod(want) and
                            [d for d in have if d != 1] == [d for d in want if d != 1])


@attrs.frozen
class _Step:
    name: str
    placement: Placement
    transposed: bool


def _plan(source, wmap, params: dict[str, torch.nn.Parameter], args: ModelArgs,
          engine_dtype: torch.dtype | None = None) -> tuple[list[_Step], list[str], list[str]]:
    """(steps, names the map does not know, shape/dtype problems) for every tensor of ``source``.
    ``engine_dtype``: in-memory weights, held to the dtype rule of ``check_update``. FP8 tensors'
    scales (``*_scale_inv``) are checked with their tensor (``bi_core/quant/fp8_loading.py``)."""
    steps, unknown, problems = [], [], []
    scheme = args.quantization
    for name in source.names():
        pl = wmap.placement(name)
        if pl is None:
            weight = fp8.scaled_weight(source, name, scheme)
            if weight is None or wmap.placement(weight) is None:
                unknown.append(name)
            continue
        have = source.shape(name)
        transposed = pl.transposable and _is_transposed(source, pl.expert_prefix, args)
        want = (pl.shape[0], pl.shape[2], pl.shape[1]) if transposed else pl.shape
        fp8_source = source.dtype(name) == FP8 or fp8.companion(source, name, scheme) is not None
        if not _fits(have, want):
            problems.append(f"tensor {name}: checkpoint shape {have}, model expects {want}")
        elif fp8_source:
            problem = fp8.source_problem(source, name, pl.param, is_fp8(params[pl.param]), scheme,
                                         in_memory=engine_dtype is not None, transposed=transposed)
            if problem is not None:
                problems.append(problem)
        elif engine_dtype is not None and source.dtype(name) not in (engine_dtype, torch.float32):
            problems.append(f"tensor {name}: dtype {source.dtype(name)}, but the engine runs {engine_dtype} "
                            f"(model.dtype) and takes in-memory weights in {_accepted(engine_dtype)}; cast it with "
                            f".to({engine_dtype}) first")
        elif not source.dtype(name).is_floating_point or source.dtype(name).itemsize < 2:
            problems.append(f"tensor {name}: dtype {source.dtype(name)}, expected float32, bfloat16 or float16, or "
                            "float8_e4m3fn with its weight_scale_inv (block-wise FP8)")
        steps.append(_Step(name, pl, transposed))
    return steps, unknown, problems


def _shard_pieces(dst: tuple, view: torch.Tensor, param: torch.nn.Parameter):
    """``(local index, part of view)`` pairs: the part of ``param_full[dst] = view`` that falls in
    this rank's shard of ``param`` (tensor parallelism), placed at its local position."""
    full, shard, tp = param.full_shape, param.shard, param.tp
    idx = tuple(dst) + (slice(None),) * (len(full) - len(dst))
    d = shard.dim
    assert isinstance(idx[d], slice), "a placement indexes the split dim with an int"
    start, stop, step = idx[d].indices(full[d])
    assert step == 1
    view_dim = d - sum(isinstance(c, int) for c in idx[:d])  # ints before d drop dims from the view
    offset = 0
    for lo, hi in shard.ranges(tp.rank, tp.world):
        a, b = max(start, lo), min(stop, hi)
        if a < b:
            local = list(idx)
            local[d] = slice(offset + a - lo, offset + b - lo)
            yield tuple(local), view.narrow(view_dim, a - start, b - a)
        offset += hi - lo


def _place(param: torch.nn.Parameter, pieces, t: torch.Tensor) -> None:
    for dst, src in pieces:
        if not hasattr(param, "shard"):
            param[dst].copy_(t[src], non_blocking=True)
            continue
        for local, part in _shard_pieces(dst, t[src], param):  # tensor parallel: this rank's part only
            param[local].copy_(part, non_blocking=True)


@torch.no_grad()
def _copy(params: dict[str, torch.nn.Parameter], source, steps: list[_Step], scheme) -> None:
    for step in steps:
        param, pl = params[step.placement.param], step.placement
        t = source.get(step.name)
        t = t.transpose(1, 2) if step.transposed else t.reshape(pl.shape)
        if not is_fp8(param):
            _place(param, pl.pieces, t)
            continue
        q, scale = fp8.fp8_values(source, step.name, t, param, scheme)  # as stored, or quantized on the way in
        _place(param, pl.pieces, q)
        full, block = getattr(param, "full_shape", param.shape), param.fp8.block
        _place(param.scale_inv, [(fp8.block_index(dst, full, block, step.name, False),
                                  fp8.block_index(src, tuple(t.shape), block, step.name, True))
                                 for dst, src in pl.pieces], scale)


def _missing(wmap, covered: dict[str, set]) -> str | None:
    """The first region no tensor filled, as 'tensor A (or B) is missing'."""
    for param, regions in wmap.required.items():
        gap = regions - covered.get(param, set())
        if gap:
            region = min(gap, key=str)
            names = [n for n, pl in wmap.by_name.items() if pl.param == param and region in pl.regions]
            return " or ".join(names[:2])
    return None


def load_weights(model: torch.nn.Module, source) -> None:
    """Fill every parameter of ``model`` from ``source`` (a :class:`CheckpointIndex`); errors name
    the tensor and both shapes; tensors the model does not use are reported in one warning."""
    args = model.args
    wmap = weight_map(args, with_mtp=model.mtp is not None)
    steps, unknown, problems = _plan(source, wmap, dict(model.named_parameters()), args)
    if problems:
        raise CheckpointError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    covered: dict[str, set] = {}
    for step in steps:
        covered.setdefault(step.placement.param, set()).update(step.placement.regions)
    missing = _missing(wmap, covered)
    if missing is not None:
        raise CheckpointError(f"tensor {missing} is missing from checkpoint {source.path}")
    for module in model.modules():  # experts narrower than the widest are zero-padded
        if hasattr(module, "zero_padding"):
            module.zero_padding()
    _copy(dict(model.named_parameters()), source, steps, args.quantization)
    for name, module in model.named_modules():  # the FP8 cache's k/v scales, read once as numbers (attention launches take them)
        if hasattr(module, "read_kv_scales"):
            module.read_kv_scales(name)
    unused = [n for n in unknown if not (args.tie_word_embeddings and n == "lm_head.weight")]
    mtp = [n for n in unused if n.startswith("mtp.")]
    if mtp and not args.mtp_num_hidden_layers:
        log.warning("checkpoint has %d MTP head tensors (mtp.*) but config.json has no mtp_num_hidden_layers: the "
                    "MTP head is not loaded (add \"mtp_num_hidden_layers\": 1 to use strategy mtp)", len(mtp))
    elif mtp:  # the strategy runs no MTP head (runtime/build.py builds_mtp_head)
        log.info("the MTP head's %d tensors (mtp.*) are not loaded: the strategy does not run it", len(mtp))
    unused = [n for n in unused if not n.startswith("mtp.")]
    if unused:
        log.warning("checkpoint has %d tensors the model does not use, e.g. %s", len(unused), unused[:5])


def update_weights(model: torch.nn.Module, source) -> int:
    """Copy the tensors of ``source`` (any subset of the checkpoint's names) into the model's
    existing parameters, in place. Every name, shape and dtype is checked before anything is
    copied, so a bad update changes nothing. Returns the number of tensors copied."""
    return apply_update(model, source, check_update(model, source))


def apply_update(model: torch.nn.Module, source, steps: list[_Step]) -> int:
    """Copy the steps ``check_update`` returned for ``source``; returns how many tensors."""
    _copy(dict(model.named_parameters()), source, steps, model.args.quantization)
    return len(steps)


@attrs.frozen
class _UpdateMap:
    """Hugging Face names (``weight_map``), then the engine's own parameter names
    (``engine.model.state_dict()``), each of which fills its whole parameter."""

    hf: WeightMap
    own: dict[str, Placement]

    def placement(self, name: str) -> Placement | None:
        return self.hf.placement(name) or self.own.get(name)


def _update_map(model: torch.nn.Module) -> _UpdateMap:
    own = {}
    for name, param in model.named_parameters():
        if is_block_scale(param):  # FP8 scales: set with their weight, which arrives in bf16/fp32
            continue
        shape = tuple(getattr(param, "full_shape", param.shape))  # tensor parallel: the whole tensor, not a shard
        own[name] = Placement(name, shape, ((ALL, ALL),), ((name,),))
    return _UpdateMap(weight_map(model.args, with_mtp=model.mtp is not None), own)


def _accepted(engine_dtype: torch.dtype) -> str:
    if engine_dtype == torch.float32:
        return "torch.float32"
    return f"{engine_dtype}, or torch.float32 (rounded to nearest {engine_dtype}, as .to() rounds)"


def check_update(model: torch.nn.Module, source) -> list[_Step]:
    """The copy steps of an update, after checking every name, shape and dtype (raises).

    Names: Hugging Face's or the engine's own parameter names. Dtypes: a checkpoint directory is
    read as at load (float32, bfloat16 or float16, cast to the engine's dtype); an in-memory
    tensor must be in the engine's dtype (``model.dtype``) or in float32, which is rounded to it
    (a trainer's fp32 master weights): a narrower or other tensor is refused, since casting it up
    would run the engine on weights of less precision than it was configured for. An FP8 model's
    FP8 parameters quantize such tensors block-wise (from the engine-dtype values); FP8 tensors with
    scales are taken from a checkpoint directory only (in memory a pair could arrive split)."""
    args = model.args
    engine_dtype = model.embed_tokens.dtype if isinstance(source, TensorDict) else None  # the engine's dtype
    steps, unknown, problems = _plan(source, _update_map(model), dict(model.named_parameters()), args, engine_dtype)
    # names the model has no place for but that a full state_dict carries: a tied head, an MTP head
    # this engine does not run
    unknown = [n for n in unknown if not ((args.tie_word_embeddings and n == "lm_head.weight") or
                                          (model.mtp is None and n.startswith("mtp.")))]
    if unknown:
        problems.insert(0, f"unknown weight names {unknown[:5]}{' ...' if len(unknown) > 5 else ''} (expected "
                           "Hugging Face Qwen3.5 names, e.g. model.layers.0.mlp.experts.gate_up_proj, or the "
                           "engine's own, as in engine.model.state_dict(), e.g. layers.0.mlp.w13)")
    problems += [f"tensor {s.name}: the FP8 KV cache's k/v scales are fixed at load (the cache holds keys and "
                 "values stored at them, and the CUDA graphs hold them)" for s in steps
                 if s.placement.param.endswith((".k_scale", ".v_scale"))]
    if problems:
        raise CheckpointError("update_weights: " + "; ".join(problems[:5]) +
                              (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "") + "; nothing was updated")
    return steps
