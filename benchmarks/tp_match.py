"""TP=2 logprobs against TP=1 on the 35B-A3B shape (4 layers, random weights, bf16, eager):
the gap between TP=2 and TP=1 on the invariant backend, next to the gap between the default
and invariant backends at TP=1 (two bf16 engines that both compute the same model: the
yardstick for "within bf16 tolerance").

    python3 benchmarks/tp_match.py"""

from __future__ import annotations

import torch

from bi_core import EngineConfig, build_engine


def config(backend: str, tp: int) -> EngineConfig:
    return EngineConfig.from_dict({
        "model": {"random": {"preset": "qwen3.5-35b-a3b", "seed": 0, "num_hidden_layers": 4},
                  "dtype": "bfloat16", "device": "cuda", "max_model_len": 1024},
        "backend": backend, "policy": {"batch_invariant": backend == "cuda_hopper_invariant"},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 2048}, "cache": {"num_blocks": 1024},
        "parallel": {"tensor_parallel_size": tp}})


def gaps() -> dict[str, torch.Tensor]:
    """|logprob differences| of (TP=2 vs TP=1) and (default vs invariant at TP=1), invariant backend."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 248320, (n,), generator=g).tolist() for n in (17, 64, 200, 333)]
    conts = [torch.randint(0, 248320, (32,), generator=g).tolist() for _ in prompts]
    out = {}
    for name, backend, tp in (("inv-tp1", "cuda_hopper_invariant", 1), ("inv-tp2", "cuda_hopper_invariant", 2),
                              ("def-tp1", "cuda_default", 1)):
        eng = build_engine(config(backend, tp))
        out[name] = torch.tensor([x for s in eng.score(prompts, conts, exact=False) for x in s.token_logprobs])
        eng.close()
        del eng
        torch.cuda.empty_cache()
    return {f"{a} vs {b}": (out[a] - out[b]).abs() for a, b in (("inv-tp2", "inv-tp1"), ("def-tp1", "inv-tp1"))}


def main() -> None:
    for label, d in gaps().items():
        print(f"{label}: {d.numel()} logprobs, max |diff| {d.max():.4f}, mean {d.mean():.5f}, "
              f"bitwise equal {int((d == 0).sum())}")


if __name__ == "__main__":
    main()
