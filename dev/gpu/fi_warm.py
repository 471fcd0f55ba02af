"""Compile FlashInfer's JIT kernels the cuda_default backend uses (decode and append wrappers,
eager and graph-mode, head_dim 256, bf16, pages of 16), so later runs find them cached. Run it in
the background at the start of a device call (dev/gpu/gpu_run.sh does with ``fi-warm``)."""

from __future__ import annotations

import torch

from bi_core.backends.cuda_common.attention import FlashInferAttentionImpl
from bi_core.ops.attention import AttentionSpec
from bi_core.ops.context import GraphShape
from bi_core.runtime.batch import build_context


def main() -> None:
    dev = torch.device("cuda")
    for hq, hkv in ((16, 2), (16, 4)):
        spec = AttentionSpec(dtype=torch.bfloat16, device=dev, num_heads=hq, num_kv_heads=hkv, head_dim=256,
                             scale=256**-0.5, rotary_dim=64, rope_theta=1e7, norm_eps=1e-6)
        impl = FlashInferAttentionImpl(spec)
        kc = torch.randn(64, 16, hkv, 256, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        qn = kn = torch.zeros(256, device=dev, dtype=torch.bfloat16)
        width = 2 * hq * 256 + 2 * hkv * 256
        for qlens, plens, graph in (([1, 1], [20, 40], None), ([5, 1], [0, 30], None), ([1], [20], (1, 1)),
                                    ([4], [20], (4, 1))):
            blocks = [[2 * i, 2 * i + 1, 2 * i + 2, 2 * i + 3] for i in range(len(qlens))]
            _, ctx = build_context([[0] * q for q in qlens], plens, blocks, list(range(len(qlens))),
                                   [q == 1 for q in qlens], block_size=16, device=dev)
            if graph is not None:
                ctx.graph = GraphShape(q_len=graph[0], bucket=graph[1])
            impl.prepare(ctx)
            impl.forward(torch.randn(sum(qlens), width, device=dev, dtype=torch.bfloat16), qn, kn, kc, vc, ctx)
        torch.cuda.synchronize()
    print("FlashInfer JIT warm", flush=True)


if __name__ == "__main__":
    main()
