"""Builders of the cuda_hopper_invariant backend. Each declares ``is_batch_invariant`` and
requires an SM90 GPU; the impls are the shared Triton ones (fixed configs, row-wise work)."""

from __future__ import annotations

from bi_core.backends.cuda_common import kernel_calls
from bi_core.backends.cuda_common.reasons import cuda_reasons
from bi_core.backends.cuda_default import builders as d
from bi_core.ops import AllReduceBuilder, AttentionBuilder, LinearBuilder
from bi_core.ops.collective import FixedOrderAllReduce, PairAllReduce, distributed_reasons, nvls_off
from bi_core.ops.vision import LayerNormBuilder, VisionAttentionBuilder


def _hopper(spec) -> list[str]:
    return cuda_reasons(spec, hopper=True)


class InvariantAttentionBuilder(AttentionBuilder):
    is_batch_invariant = True

    def check(self, spec, policy):
        reasons = _hopper(spec)
        group = spec.num_heads // max(spec.num_kv_heads, 1)
        if spec.num_heads % spec.num_kv_heads or 64 % group:
            reasons.append(f"GQA group {spec.num_heads}/{spec.num_kv_heads} must divide 64")
        if spec.head_dim & (spec.head_dim - 1) or spec.head_dim > 256:
            reasons.append(f"head_dim must be a power of two <= 256, not {spec.head_dim}")
        return reasons + d.rope_reasons(spec)

    def build(self, spec):
        from bi_core.backends.cuda_common.attention import TritonPagedAttentionImpl

        return TritonPagedAttentionImpl(spec)


class InvariantLinearBuilder(LinearBuilder):
    is_batch_invariant = True
    weight_formats = ("dense", "fp8_block")

    def check(self, spec, policy):
        return _hopper(spec) + d.fp8_reasons(spec)

    def build(self, spec):
        if spec.weight_format == "fp8_block":
            return kernel_calls.Fp8LinearImpl(spec.silu_mul)
        return kernel_calls.TritonLinearImpl(spec.device, spec.silu_mul)


class _OnHopper:
    """Mixin: the shared Triton impl of the default builder, promised invariant, SM90 only."""

    is_batch_invariant = True

    def check(self, spec, policy):
        return _hopper(spec) + d.fp8_reasons(spec)


class InvariantNormBuilder(_OnHopper, d.DefaultNormBuilder):
    pass


class InvariantTopKBuilder(_OnHopper, d.DefaultTopKBuilder):
    pass


class InvariantMoEBuilder(_OnHopper, d.DefaultMoEBuilder):
    pass


class InvariantGdnBuilder(d.DefaultGdnBuilder):
    is_batch_invariant = True
    pin_autotune = True


class InvariantSamplingBuilder(_OnHopper, d.DefaultSamplingBuilder):
    pass


class InvariantAllReduceBuilder(AllReduceBuilder):
    """Two ranks (NVLS off): NCCL's all-reduce, r0 + r1 whatever the algorithm (``PairAllReduce``).
    Otherwise the fixed rank-order sum (all-to-all, local float32 sum in rank order, all-gather)."""

    is_batch_invariant = True

    def check(self, spec, policy):
        return cuda_reasons(spec, modules=()) + distributed_reasons()

    def build(self, spec):
        if spec.world_size == 2 and nvls_off():
            return PairAllReduce(spec)
        return FixedOrderAllReduce(spec)


class InvariantAllGatherBuilder(_OnHopper, d.DefaultAllGatherBuilder):
    pass


class InvariantLoraBuilder(d.DefaultLoraBuilder):
    """The gather mat-vec kernel: one program per row, block sizes from K and N only."""

    is_batch_invariant = True

    def check(self, spec, policy):
        return _hopper(spec)


class InvariantLayerNormBuilder(LayerNormBuilder):
    """Row-wise Triton LayerNorm: a row's result depends on that row alone."""

    is_batch_invariant = True

    def check(self, spec, policy):
        return _hopper(spec)

    def build(self, spec):
        from bi_core.backends.cuda_common.vision import TritonLayerNormImpl

        return TritonLayerNormImpl(spec)


class InvariantVisionAttentionBuilder(VisionAttentionBuilder):
    """Triton attention within each image, fixed tiles from the image's first row."""

    is_batch_invariant = True

    def check(self, spec, policy):
        reasons = _hopper(spec)
        if spec.head_dim > 256:
            reasons.append(f"head_dim must be <= 256, not {spec.head_dim}")
        return reasons

    def build(self, spec):
        from bi_core.backends.cuda_common.vision import TritonVisionAttentionImpl

        return TritonVisionAttentionImpl(spec)
