"""Checkpoint tensors into FP8 parameters: an FP8 tensor arrives with its scales (``name`` + the
scheme's ``scale_suffix``: ``weight_scale_inv`` officially, ``weight_scale`` in compressed-tensors),
a bf16/fp32 one is quantized block-wise on the way in (load and update alike, per checkpoint tensor:
as an FP8 checkpoint of it would hold it); both land through the weight map's placements, the
scales at the same places counted in blocks."""

from __future__ import annotations

import torch

from bi_core.errors import CheckpointError
from bi_core.quant.fp8_numerics import FP8, quantize_blocks, scale_shape
from bi_core.quant.params import SCALE_SUFFIX
from bi_core.quant.scheme import Fp8Scheme

SCALE_DTYPES = (torch.float32, torch.bfloat16)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_suffix(scheme: Fp8Scheme | None) -> str:
    """A checkpoint's name for a weight's FP8 scales: the weight's name + this."""
    return scheme.scale_suffix if scheme is not None else SCALE_SUFFIX


def companion(source, name: str, scheme: Fp8Scheme | None) -> str | None:
    """The scale tensor stored with ``name`` in ``source``, if any."""
    scale = name + scale_suffix(scheme)
    return scale if source.has(scale) else None


def scaled_weight(source, name: str, scheme: Fp8Scheme | None) -> str | None:
    """The weight in ``source`` whose scales ``name`` holds, if it is one's scale tensor."""
    suffix = scale_suffix(scheme)
    weight = name[: -len(suffix)]
    return weight if name.endswith(suffix) and source.has(weight) else None


def source_problem(source, name: str, param: str, fp8_param: bool, scheme: Fp8Scheme | None,
                   in_memory: bool, transposed: bool) -> str | None:
    """What is wrong with FP8 tensor ``name`` (float8_e4m3fn, or with a scale) for ``param``; None if fine."""
    dtype, scale = source.dtype(name), companion(source, name, scheme)
    if in_memory:
        return (f"tensor {name}: {dtype}{' with a scale' if scale else ''}: weights in memory are taken in bf16/fp32 "
                "(an FP8 model quantizes them block-wise on the way in); FP8 + weight_scale_inv pairs are accepted from "
                "a checkpoint directory only")
    if dtype != FP8:
        return f"tensor {name} has {scale} but is {dtype}, not float8_e4m3fn"
    if not fp8_param:
        return (f"tensor {name} is FP8, but the engine holds {param} unquantized (config.json's quantization_config "
                "does not make it FP8: no quantization_config, listed in modules_to_not_convert, or a weight this "
                "engine never quantizes: embeddings, lm_head, norms, router gates, GDN conv1d/A_log/dt_bias)")
    if scale is None:
        return f"tensor {name} is float8_e4m3fn but {name}{scale_suffix(scheme)} is missing"
    if transposed:
        return f"tensor {name}: FP8 experts stored transposed ([E, in, out]) are not supported"
    if scheme.source_scales == "row":  # a scale per output row (compressed-tensors' channel) or one (tensor)
        shape, rows = tuple(source.shape(name)), tuple(source.shape(name))[:-1]
        if tuple(source.shape(scale)) not in ((*rows, 1), rows, (1,), ()) or source.dtype(scale) not in SCALE_DTYPES:
            return (f"tensor {scale}: {source.dtype(scale)} {list(source.shape(scale))}, expected float32 or bfloat16 "
                    f"{list((*rows, 1))} (a scale per output row of {name} {list(shape)}) or [1] (one per tensor)")
        return None
    want = scale_shape(source.shape(name), scheme.block)
    if source.shape(scale) != want or source.dtype(scale) not in SCALE_DTYPES:
        return (f"tensor {scale}: {source.dtype(scale)} {list(source.shape(scale))}, expected float32 or bfloat16 "
                f"{list(want)} (one scale per {scheme.block[0]}x{scheme.block[1]} block of {name} "
                f"{list(source.shape(name))})")
    return None


def fp8_values(source, name: str, t: torch.Tensor, param: torch.nn.Parameter,
               scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values, float32 scales) of tensor ``t`` (``name`` in ``source``) for FP8 ``param``: as
    stored, or quantized from ``t`` rounded to the model dtype. Scales per output row (or one per
    tensor: ``scheme.source_scales`` "row"): ``t`` is dequantized (in float32) and quantized as a
    bf16/fp32 tensor of those values would be."""
    if t.dtype == FP8:
        scale = source.get(name + scheme.scale_suffix).float()
        if scheme.source_scales != "row":
            return t, scale.reshape(scale_shape(tuple(t.shape), param.fp8.block))
        scale = scale.reshape(*t.shape[:-1], 1) if scale.numel() > 1 else scale.reshape(())
        t = t.float() * scale.to(t.device)
    return quantize_blocks(t.to(param.device, param.dense_dtype), param.fp8.block)


def block_index(idx: tuple, shape: tuple[int, ...], block: tuple[int, int], name: str, source_side: bool) -> tuple:
    """The scale index of ``tensor[idx]`` (a tensor of ``shape``): the last two dims in blocks. A
    region must start on a block; on the source side it must also end on one (or at the end), since
    a block's one scale cannot be split between two destinations."""
    nd = len(shape)
    full = tuple(idx) + (slice(None),) * (nd - len(idx))
    out = list(full[: nd - 2])
    for d in (nd - 2, nd - 1):
        b = block[d - nd + 2]
        start, stop, _ = full[d].indices(shape[d])
        if start % b or (source_side and stop % b and stop != shape[d]):
            raise CheckpointError(f"tensor {name}: its part [{start}, {stop}) of dim {d} (size {shape[d]}) is not made "
                                  f"of whole {b}-wide FP8 blocks, so its block scales cannot be placed")
        out.append(slice(start // b, _cdiv(stop, b)))
    return tuple(out)
