"""Compile the FP8 kernels (and the MoE routing's, and the FP8 KV cache's write) for sm_90 on any machine, GPU or not: Triton's front end, its passes and
its bundled ptxas run on the CPU. The interpreter (TRITON_INTERPRET=1, what the CPU tests run)
executes the kernels as Python and misses what only the compiler rejects: in the thirty-second
session an early ``return`` under a constexpr ``if`` passed every interpreter test and failed to
compile on the H200 (benchmarks section 41). It also shows what the compiled code does: whether the
weight tiles come by TMA (``cp.async.bulk.tensor``), whether the dots are wgmma, the shared memory.

  python3 dev/gpu/sm90_compile.py            one line per variant; exit 1 if any fails to compile
  python3 dev/gpu/sm90_compile.py --json     the same as one JSON object (tests/kernels/test_sm90_compile.py)

Run it without TRITON_INTERPRET (the kernels must be decorated for compilation)."""

from __future__ import annotations

import json
import os
import re
import sys

WARPS, STAGES = 4, 4


def variants():
    """(name, kernel, argument types, constexprs, whether the weight tiles should come by TMA,
    whether it has dots: each one an fp8 wgmma)."""
    from bi_core.kernels import fp8, fp8_moe, moe, qk_norm_rope

    yield ("KV write, FP8 cache at k/v scales", qk_norm_rope._qk_norm_rope_kernel,
           {"QKV": "*bf16", "QW": "*bf16", "KW": "*bf16", "INV_FREQ": "*fp32", "POS": "*i64", "SLOTS": "*i64",
            "QOUT": "*bf16", "KC": "*fp8e4nv", "VC": "*fp8e4nv", "eps": "fp32", "k_inv": "fp32", "v_inv": "fp32"},
           {"NUM_HEADS": 16, "NUM_KV_HEADS": 2, "D": 256, "ROT": 64, "KV_FP8": True, "PDL": True}, False, False)

    routing = {"TOP_K": 8, "SLOTS": 9, "NUM_EXPERTS": 257, "E_BLOCK": 512, "CHUNK": moe.ROUTE_CHUNK, "PDL": True}
    yield ("routing, chunks counted", moe._align_count_kernel, {"IDS": "*i64", "COUNTS": "*i32", "SORTED": "*i32"},
           {**routing, "FILL": 1024}, False, False)
    yield ("routing, chunks placed", moe._align_place_kernel,
           {"IDS": "*i64", "COUNTS": "*i32", "SORTED": "*i32", "BLOCK_EXPERT": "*i32"},
           {**routing, "BLOCK_M": 64, "FILL": 64}, False, False)

    def desc(rows: int) -> str:
        return f"tensordesc<fp8e4nv[{rows}, 128]>"

    for tma in (False, True):
        tag = "tma" if tma else "ptr"
        w64, w128 = (desc(64), desc(128)) if tma else ("*fp8e4nv", "*fp8e4nv")
        if not tma:  # (its weight tiles by TMA: measured, no gain; branch wip/fp8-dense-tma)
            yield ("dense decode, swapped, split ptr", fp8._fp8_gemm_kernel,
                   {"A": "*fp8e4nv", "AS": "*fp32", "B": w64, "BS": "*fp32", "C": "*bf16", "WS": "*fp32",
                    "LOCKS": "*i32"},
                   {"BLOCK_M": 16, "BLOCK_N": 64, "SPLIT_K": 4, "INLINE": False, "GROUP_M": 8, "DOT": 0, "SWAP": True,
                    "PDL": True}, False, True)
            yield ("dense prefill by TMA", fp8._fp8_gemm_tma_kernel,
                   {"a_desc": "tensordesc<fp8e4nv[64, 128]>", "AS": "*fp32", "b_desc": desc(128),
                    "BS": "*fp32", "C": "*bf16"},
                   {"BLOCK_M": 64, "BLOCK_N": 128, "SPLIT_K": 1, "GROUP_M": 8, "DOT": 0, "PDL": True}, True, True)
        pair = {"TOP_K": 8, "SLOTS": 9, "E_BLOCK": 512, "BLOCK_M": 16, "DOT": 0, "SWAP": True, "TMA": tma, "PDL": True}
        yield (f"experts per pair, gate/up {tag}", fp8_moe._fp8_pair_up_kernel,
               {"XQ": "*fp8e4nv", "XS": "*fp32", "W": w64, "WS": "*fp32", "H": "*bf16", "IDS": "*i64"},
               {**pair, "BLOCK_N": 64}, tma, True)
        yield (f"experts per pair, down {tag}", fp8_moe._fp8_pair_down_kernel,
               {"HQ": "*fp8e4nv", "HS": "*fp32", "W": w128, "WS": "*fp32", "Y": "*bf16", "WTS": "*fp32", "IDS": "*i64",
                "SHARED_LOGIT": "*bf16", "OUT": "*bf16", "LOCKS": "*i32"}, {**pair, "BLOCK_N": 128}, tma, True)
        grouped = {"A": "*fp8e4nv", "AS": "*fp32", "W": w64, "WS": "*fp32", "C": "*bf16", "SORTED": "*i32",
                   "BLOCK_EXPERT": "*i32"}
        yield (f"experts sorted, swapped 16-row blocks {tag}", fp8_moe._fp8_grouped_kernel, grouped,
               {"A_ROW_DIV": 9, "SILU_MUL": True, "ROUTE_M": 16, "BLOCK_M": 16, "BLOCK_N": 64, "DOT": 0, "SWAP": True,
                "TMA": tma, "PDL": True}, tma, True)
        yield (f"experts sorted, 64-row blocks {tag}", fp8_moe._fp8_grouped_kernel, {**grouped, "W": w128},
               {"A_ROW_DIV": 1, "SILU_MUL": False, "ROUTE_M": 64, "BLOCK_M": 64, "BLOCK_N": 128, "DOT": 0,
                "SWAP": False, "TMA": tma, "PDL": True}, tma, True)


def compile_all() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    out = {}
    for name, kernel, types, consts, tma, dots in variants():
        sig = {n: types.get(n, "i32") for n in kernel.arg_names if n not in consts}
        sig["pdl_early"] = "u1"
        sig.update({n: "constexpr" for n in consts})
        try:
            compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=target,
                                      options={"num_warps": WARPS, "num_stages": STAGES})
        except Exception as e:  # reported per variant: the others still compile
            out[name] = {"error": f"{type(e).__name__}: {str(e)[-600:]}"}
            continue
        ptx = compiled.asm["ptx"]
        out[name] = {"tma_expected": tma, "wgmma_expected": dots, "bulk_tensor_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                     "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)), "shared_bytes": compiled.metadata.shared}
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sm90_compile.py: unset TRITON_INTERPRET (the kernels must be decorated for compilation)")
    results = compile_all()
    if "--json" in sys.argv[1:]:
        print(json.dumps(results))
    else:
        for name, r in results.items():
            print(f"{name:45s} " + (r["error"] if "error" in r else
                                    f"TMA loads {r['bulk_tensor_loads']:2d}  wgmma {r['wgmma']:2d}  "
                                    f"shared {r['shared_bytes']:6d} B"))
    sys.exit(1 if any("error" in r for r in results.values()) else 0)


if __name__ == "__main__":
    main()
