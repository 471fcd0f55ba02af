"""cuda_hopper_invariant: batch-invariant kernels for SM90. Every op's row result depends only on
that row: fixed-K-order Triton GEMMs (no cuBLAS), one Triton paged-attention kernel for prefill,
decode and mixed steps, row-wise norms/top-k/sampler, fla GDN prefill with pinned configs."""

from __future__ import annotations

from bi_core.hookspecs import hookimpl
from bi_core.registry import Backend

NAME = "cuda_hopper_invariant"


@hookimpl
def bi_register_backends(register) -> None:
    from bi_core.backends.cuda_common import COMPILE_MANIFESTS
    from bi_core.backends.cuda_hopper_invariant import builders as b

    register(Backend(name=NAME, description="batch-invariant kernels for Hopper (SM90)",
                     builders=(b.InvariantAttentionBuilder(), b.InvariantLinearBuilder(), b.InvariantNormBuilder(),
                               b.InvariantTopKBuilder(), b.InvariantMoEBuilder(), b.InvariantGdnBuilder(),
                               b.InvariantSamplingBuilder(), b.InvariantAllReduceBuilder(),
                               b.InvariantAllGatherBuilder(), b.InvariantLoraBuilder(), b.InvariantLayerNormBuilder(),
                               b.InvariantVisionAttentionBuilder()),
                     compile_manifests=COMPILE_MANIFESTS))
