"""The GDN decode kernels at the Qwen3.5-35B-A3B shape (16 key heads,
32 value heads, 128 x 128 float32 state per value head): time per call and the state bandwidth
they reach at decode batches 1 / 8 / 64 / 256, for each launch shape (split: conv, then a
program per value head; fused: a program per key head) and speed knob (BLOCK_C: the split conv's
channels per program; the recurrence's warps), and whether every config gives the same bits. ``--tokens N``
gives every sequence N tokens, the state kept after each (an MTP verify step). With
``.baseline/`` (an older tree, see gpu_run.sh) the kernel found there is timed too and compared
bit for bit.

python3 benchmarks/kernels/gdn_sweep.py [--batch-sizes 1,8,64,256] [--tokens 1] [--json out.jsonl]"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from functools import partial

import torch
import triton

from bi_core.kernels.gdn_decode import gdn_decode

DEV = torch.device("cuda")
HK, HV, D = 16, 32, 128
CONV_DIM = 2 * HK * D + HV * D
CONFIGS = ([{"split": True, "BLOCK_C": c, "num_warps": w} for c in (64, 128, 256, 512) for w in (4, 8)]
           + [{"split": False, "num_warps": w} for w in (4, 8)])


def _baseline():
    path = os.path.join(".baseline", "bi_core", "kernels", "gdn_decode.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("baseline_gdn_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.gdn_decode


def inputs(b: int, n: int):
    """b sequences of n tokens; with n > 1 a ring of n slots per sequence (token t's state to slot
    (t + 1) % n of it, as runtime/batch.py lays out a verify step)."""
    g = torch.Generator(device=DEV).manual_seed(b)
    proj = torch.randn(b * n, CONV_DIM + HV * D + 2 * HV, device=DEV, generator=g).bfloat16()
    w = dict(conv=(torch.randn(CONV_DIM, 4, device=DEV, generator=g) / 2).bfloat16(),
             a_log=torch.rand(HV, device=DEV, generator=g) * 2, dt_bias=torch.randn(HV, device=DEV, generator=g),
             norm=(1 + 0.1 * torch.randn(D, device=DEV, generator=g)).bfloat16())
    conv = torch.randn(b * n + 1, CONV_DIM, 3, device=DEV, generator=g).bfloat16()
    state = torch.randn(b * n + 1, HV, D, D, device=DEV, generator=g) * 0.1
    ar = torch.arange(b + 1, device=DEV, dtype=torch.int64)
    tok = torch.arange(b * n, device=DEV, dtype=torch.int64)
    meta = dict(cu=ar * n, ctx=torch.full((b,), 100, device=DEV, dtype=torch.int64), slots=ar[:b] * n,
                token_slots=tok // n * n + (tok % n + 1) % n, seq_ids=ar[:b].clone(), per_token=n > 1)
    return proj, w, conv, state, meta


def call(fn, proj, w, conv, state, meta, out, config=None):
    kw = {} if config is None else {"config": config}
    return fn(proj, w["conv"], w["a_log"], w["dt_bias"], w["norm"], conv, state, meta["cu"], meta["ctx"],
              meta["slots"], meta["token_slots"], meta["seq_ids"], out, num_k_heads=HK, head_k_dim=D, eps=1e-6,
              per_token=meta["per_token"], **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,64,256")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    old = _baseline()
    rows = []
    for b in (int(x) for x in a.batch_sizes.split(",")):
        n = a.tokens
        proj, w, conv, state, meta = inputs(b, n)
        state_bytes = (1 + n) * b * HV * D * D * 4  # read once, stored once (n = 1) or after every token
        variants = [("baseline", old, None)] if old is not None else []
        variants += [(f"split/block{c['BLOCK_C']}/w{c['num_warps']}" if c["split"] else f"fused/w{c['num_warps']}",
                      gdn_decode, c) for c in CONFIGS]
        bits = {}  # every variant's result on fresh copies first, before any timing runs
        for name, fn, cfg in variants:
            out = torch.empty(b * n, HV * D, device=DEV, dtype=torch.bfloat16)
            c, s = conv.clone(), state.clone()
            call(fn, proj, w, c, s, meta, out, cfg)
            torch.cuda.synchronize()
            bits[name] = (out, s, c)
        first = bits[variants[0][0]]
        same = {name: all(torch.equal(x, y) for x, y in zip(r, first)) for name, r in bits.items()}
        del bits
        for name, fn, cfg in variants:
            out = torch.empty(b * n, HV * D, device=DEV, dtype=torch.bfloat16)
            c, s = conv.clone(), state.clone()
            us = triton.testing.do_bench_cudagraph(partial(call, fn, proj, w, c, s, meta, out, cfg), rep=50,
                                                   return_mode="median") * 1e3
            torch.cuda.synchronize()
            row = dict(batch=b, tokens=n, variant=name, us=round(us, 2), state_tb_s=round(state_bytes / us / 1e6, 2),
                       same_bits_as_first=same[name])
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
