"""cuda_default: the fastest path on NVIDIA GPUs, no invariance promise. cuBLAS linears,
FlashInfer paged attention, fla chunked GDN prefill, Triton kernels elsewhere, CUDA graphs."""

from __future__ import annotations

from bi_core.hookspecs import hookimpl
from bi_core.registry import Backend

NAME = "cuda_default"


@hookimpl
def bi_register_backends(register) -> None:
    from bi_core.backends.cuda_common import COMPILE_MANIFESTS
    from bi_core.backends.cuda_default import builders as b

    register(Backend(name=NAME, description="fastest CUDA path; no batch invariance",
                     builders=(b.DefaultAttentionBuilder(), b.DefaultLinearBuilder(), b.DefaultNormBuilder(),
                               b.DefaultTopKBuilder(), b.DefaultMoEBuilder(), b.DefaultGdnBuilder(),
                               b.DefaultSamplingBuilder(), b.DefaultAllReduceBuilder(), b.DefaultAllGatherBuilder(),
                               b.DefaultLoraBuilder(), b.DefaultLayerNormBuilder(), b.DefaultVisionAttentionBuilder()),
                     compile_manifests=COMPILE_MANIFESTS))
