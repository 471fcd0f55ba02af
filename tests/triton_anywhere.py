"""A test backend: the invariant backend's Triton kernels without their SM90 check, so whole
engines run them on the CPU (Triton's interpreter) or any GPU. GDN decode rows run the fused decode
kernel, prefill rows the reference chunked form (fla's chunk kernel does not run in the
interpreter). Its GDN prefill reads the step's host lists, so graph steps over it run in the rerun
mode (``graph.capture: false``: its configs ask for it). Used by tests/kernels and tests/train."""

from __future__ import annotations

from bi_core import hookimpl
from bi_core.backends.cuda_common.gdn import CudaGdnImpl
from bi_core.backends.cuda_hopper_invariant import builders as inv
from bi_core.backends.reference.gdn import ReferenceGdnImpl
from bi_core.ops import GdnBuilder
from bi_core.registry import Backend

RERUN_GRAPHS = {"enabled": True, "capture": False}  # the graph section of a config over this backend


def _anywhere(cls):
    """The same builder without its device check."""
    return type(f"Anywhere{cls.__name__}", (cls,), {"check": lambda self, spec, policy: []})()


class DecodeKernelGdnImpl(CudaGdnImpl):
    """Recurrent rows through the fused Triton kernel, chunked rows through the reference."""

    def _prefill(self, proj, weights, conv_state, state, ctx, meta, out):
        full = ReferenceGdnImpl(self.spec).forward(proj, weights, conv_state, state, ctx, meta["seq_ids"].tolist())
        rows = meta["rows"]  # a slice (contiguous chunked rows) or an index
        out[rows] = full[rows]


class DecodeKernelGdnBuilder(GdnBuilder):
    is_batch_invariant = True

    def build(self, spec):
        return DecodeKernelGdnImpl(spec, pin_autotune=False)


class TritonAnywhere:
    @hookimpl
    def bi_register_backends(self, register):
        register(Backend(name="triton_anywhere", builders=(
            _anywhere(inv.InvariantAttentionBuilder), _anywhere(inv.InvariantLinearBuilder),
            _anywhere(inv.InvariantNormBuilder), _anywhere(inv.InvariantTopKBuilder),
            _anywhere(inv.InvariantMoEBuilder), _anywhere(inv.InvariantSamplingBuilder),
            _anywhere(inv.InvariantLoraBuilder), _anywhere(inv.InvariantLayerNormBuilder),
            _anywhere(inv.InvariantVisionAttentionBuilder), DecodeKernelGdnBuilder()),
            graph_capture_refusal="its GDN prefill runs the reference impl, which reads the step's host lists"))
