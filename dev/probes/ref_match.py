"""Diagnose a CUDA backend against the reference on a random real-shape model (first-step logits):
per request, the relative error of the backend and of the bf16 reference against an fp32
reference run, whether the first greedy token agrees, and the fp32 top-2 logit gap (a small gap
is a near-tie that bf16 may flip).

python3 dev/probes/ref_match.py BACKEND PRESET [LAYERS]"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")
from gpu.test_engine_gpu import gpu_config, prompts  # noqa: E402

from bi_core import SamplingParams, build_engine  # noqa: E402


def main() -> None:
    backend, preset = sys.argv[1], sys.argv[2]
    layers = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    ps = prompts(6, vocab=248320)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    logits, outs = {}, {}
    for name, dtype in ((backend, "bfloat16"), ("reference", "bfloat16"), ("reference", "float32")):
        cfg = gpu_config(name, preset, layers=layers, invariant=name == "cuda_hopper_invariant")
        eng = build_engine(cfg.replace(model={"dtype": dtype}))
        eng.on_logits = lambda seqs, rows, key=(name, dtype): [
            logits.setdefault((key, s.request_id), r.float()) for s, r in zip(seqs, rows)]
        outs[(name, dtype)] = eng.generate(ps, params)
        del eng
        torch.cuda.empty_cache()
    for i in range(len(ps)):
        t = logits[(("reference", "float32"), i)]
        ours = float((logits[((backend, "bfloat16"), i)] - t).norm() / t.norm())
        ref = float((logits[(("reference", "bfloat16"), i)] - t).norm() / t.norm())
        top2 = torch.topk(t, 2).values
        tok = [outs[k][i].token_ids[0] for k in ((backend, "bfloat16"), ("reference", "bfloat16"), ("reference", "float32"))]
        print(f"req {i} len {len(ps[i]):>3}: err ours {ours:.4f} ref-bf16 {ref:.4f} | first token ours/ref-bf16/fp32 "
              f"{tok} | fp32 top-2 gap {float(top2[0] - top2[1]):.4f} (logit scale {float(t.std()):.2f})", flush=True)


if __name__ == "__main__":
    main()
