"""Quick decode timing: default vs invariant engine on a reduced-depth Qwen3.5-35B-A3B shape.

python3 benchmarks/decode_quick.py [num_layers] [batch sizes...]"""

from __future__ import annotations

import sys

import torch

from bi_core import EngineConfig, build_engine
from bi_core.tools.bench import bench_decode, measure_bandwidth


def config(backend: str, layers: int, graphs: bool, max_seqs: int = 64, quantization: str | None = None) -> EngineConfig:
    return EngineConfig.from_dict({
        "model": {"random": {"preset": "qwen3.5-35b-a3b", "seed": 0, "num_hidden_layers": layers},
                  "dtype": "bfloat16", "device": "cuda", "max_model_len": 4096, "quantization": quantization},
        "backend": backend, "policy": {"batch_invariant": backend == "cuda_hopper_invariant"},
        "graph": {"enabled": graphs}, "scheduler": {"max_num_seqs": max_seqs, "max_num_batched_tokens": 8192},
        "cache": {"num_blocks": max(64 * 4096, max_seqs * 1024) // 16 + 64},
    })


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    batches = [int(b) for b in sys.argv[2:]] or [1, 8, 64]
    bw = measure_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; layers {layers}")
    for backend in ("cuda_default", "cuda_hopper_invariant"):
        for graphs in (False, True):
            eng = build_engine(config(backend, layers, graphs))
            for b in batches:
                r = bench_decode(eng, b, 512, 20, bw)
                print(f"{backend:<22} graphs={graphs!s:<5} B={b:<3} {r.ms_per_step:7.3f} ms/step "
                      f"floor {r.floor_ms:6.3f} ms  x{r.over_floor:5.2f}  {r.tokens_per_s:8.1f} tok/s", flush=True)
            del eng
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
