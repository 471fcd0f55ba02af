"""How many GPUs a model's weights need, in the model dtype and in block FP8, from its shapes: the
model is built on the meta device at each tensor-parallel size (no memory, no kernels) and its
parameters counted, FP8 scales and replicated tensors included; what is left of each GPU is
given as KV-cache tokens, after the GDN state of ``scheduler.max_num_seqs`` sequences (each with
``ring`` state slots: 1 + the drafts a speculative strategy verifies per step, as the engine's
cache reserves them)."""

from __future__ import annotations

import attrs
import torch

from bi_core.errors import BiEngineError
from bi_core.models.args import ModelArgs
from bi_core.ops.attention import kv_cache_torch_dtype
from bi_core.parallel.shard import TPInfo
from bi_core.quant.scheme import Fp8Scheme

GiB = 2**30
SIZES = (1, 2, 4, 8, 16, 32, 64)
# total memory as torch reports it (get_device_properties().total_memory), when the GPU is not here
KNOWN_GPUS = (("H100 80GB", int(79.19 * GiB)), ("H200 141GB", int(139.8 * GiB)))


class _NoOps:
    """An op factory that builds nothing (the shapes are all that is counted)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.base = {"device": torch.device("meta"), "dtype": dtype}

    def build(self, op, spec):
        return None


def weight_bytes(args: ModelArgs, dtype: torch.dtype, world: int, with_mtp: bool) -> int:
    """One rank's weight bytes at ``world`` ranks (raises BiEngineError if the model cannot be split so)."""
    from bi_core.models.qwen3_5 import Qwen35Model, check_tensor_parallel

    check_tensor_parallel(args, world)
    model = Qwen35Model(args, _NoOps(dtype), dtype, torch.device("meta"), with_mtp=with_mtp, tp=TPInfo(0, world))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def state_bytes(args: ModelArgs, config, dtype: torch.dtype, world: int, with_mtp: bool) -> tuple[int, int]:
    """(KV-cache bytes per token, GDN state bytes per sequence) on one of ``world`` ranks."""
    kv_item = kv_cache_torch_dtype(args.kv_cache_dtype, dtype).itemsize
    attn_layers = len(args.full_attention_layers) + (1 if with_mtp else 0)
    kv = attn_layers * 2 * max(1, args.num_key_value_heads // world) * args.head_dim * kv_item
    ssm_item = 4 if config.cache.ssm_state_dtype == "float32" else 2
    per_layer = (args.linear_num_value_heads // world * args.linear_key_head_dim * args.linear_value_head_dim * ssm_item
                 + args.conv_dim // world * (args.linear_conv_kernel_dim - 1) * dtype.itemsize)
    return kv, len(args.gdn_layers) * per_layer


def _gpus() -> tuple[tuple[str, int], ...]:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return ((props.name, props.total_memory),)
    return KNOWN_GPUS


def _fit(args, config, dtype, with_mtp, usable: float, ring: int) -> str:
    """The fewest GPUs holding the weights (and, if that leaves no room, the fewest leaving some)."""
    seqs, short = config.scheduler.max_num_seqs, None
    slots = f" ({ring} state slots each)" if ring > 1 else ""
    for world in SIZES:
        try:
            weights = weight_bytes(args, dtype, world, with_mtp)
        except BiEngineError:
            continue
        if weights > usable:
            continue
        kv, gdn = state_bytes(args, config, dtype, world, with_mtp)
        room = usable - weights - gdn * seqs * ring
        gpus = f"{world} GPU{'s' if world > 1 else ''}"
        if room > 0:
            fit = (f"{gpus} ({weights / GiB:.1f} GiB each; KV room ~{int(room // kv):,} tokens after the GDN state of "
                   f"{seqs} sequences{slots})")
            return fit if short is None else f"{short}; {fit}"
        short = short or (f"{gpus} {'hold' if world > 1 else 'holds'} the weights ({weights / GiB:.1f} of {usable / GiB:.1f} GiB usable) but not "
                          f"the GDN state of {seqs} sequences{slots} ({gdn * seqs * ring / GiB:.1f} GiB) too")
    return short or f"more than {SIZES[-1]} GPUs, or no size that splits it"


def summary(config, args: ModelArgs, with_mtp: bool, ring: int = 1) -> str:
    """The explain lines: total weights and the GPUs needed, in the model dtype and in FP8
    (``ring``: GDN state slots per sequence, the strategy's ``state_ring_for``)."""
    dtype = getattr(torch, config.model.dtype)
    fp8 = attrs.evolve(args, quantization=args.quantization or Fp8Scheme())
    dense = attrs.evolve(args, quantization=None)
    util = config.cache.gpu_memory_utilization
    lines = [f"weights and GPUs, from the shapes (usable memory: cache.gpu_memory_utilization {util}):"]
    for label, a in ((config.model.dtype, dense), ("fp8 (block 128x128)", fp8)):
        try:
            total = weight_bytes(a, dtype, 1, with_mtp)
        except BiEngineError as e:  # e.g. shapes that cannot be held in 128x128 blocks
            lines.append(f"  {label}: not possible ({e})")
            continue
        fits = "; ".join(f"{name}: {_fit(a, config, dtype, with_mtp, memory * util, ring)}" for name, memory in _gpus())
        lines.append(f"  {label}: {total / GiB:.1f} GiB of weights; {fits}")
    kv, gdn = state_bytes(args, config, dtype, 1, with_mtp)
    kv_dtype = str(kv_cache_torch_dtype(args.kv_cache_dtype, dtype)).removeprefix("torch.")
    lines.append(f"  KV cache ({kv_dtype}) {kv / 1024:.1f} KiB per token and GDN state {gdn / 2**20:.1f} MiB per sequence on one GPU "
                 "(fewer per GPU when split); activations and CUDA graphs need more")
    return "\n".join(lines)
