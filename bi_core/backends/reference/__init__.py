"""Reference backend: pure PyTorch for every op, any device, float32 and bfloat16.

It mirrors transformers' Qwen3.5 rounding order and is the numerical yardstick for the other
backends. It never claims batch invariance: asked for it, it raises.
"""

from __future__ import annotations

from bi_core.hookspecs import hookimpl
from bi_core.registry import Backend

NAME = "reference"


@hookimpl
def bi_register_backends(register) -> None:
    from bi_core.backends.reference.attention import ReferenceAttentionBuilder
    from bi_core.backends.reference.collective import ReferenceAllGatherBuilder, ReferenceAllReduceBuilder
    from bi_core.backends.reference.gdn import ReferenceGdnBuilder
    from bi_core.backends.reference.linear import ReferenceLinearBuilder
    from bi_core.backends.reference.lora import ReferenceLoraBuilder
    from bi_core.backends.reference.moe import ReferenceMoEBuilder
    from bi_core.backends.reference.norm import ReferenceNormBuilder
    from bi_core.backends.reference.sampling import ReferenceSamplingBuilder
    from bi_core.backends.reference.topk import ReferenceTopKBuilder
    from bi_core.backends.reference.vision import ReferenceLayerNormBuilder, ReferenceVisionAttentionBuilder

    register(
        Backend(
            name=NAME,
            description="pure PyTorch, any device; numerical reference",
            builders=(
                ReferenceAttentionBuilder(), ReferenceLinearBuilder(), ReferenceNormBuilder(),
                ReferenceTopKBuilder(), ReferenceMoEBuilder(), ReferenceGdnBuilder(),
                ReferenceSamplingBuilder(), ReferenceAllReduceBuilder(), ReferenceAllGatherBuilder(),
                ReferenceLoraBuilder(),
                ReferenceLayerNormBuilder(), ReferenceVisionAttentionBuilder(),
            ),
            invariance_refusal="its PyTorch ops (matmul, softmax, conv) pick kernels by shape, so a row's "
            "bits can change with the batch; use cuda_hopper_invariant on an SM90 GPU",
            graph_capture_refusal="its impls read the step's host lists (block tables, lengths, slots), which a "
            "captured graph's replays would not update",
        )
    )
