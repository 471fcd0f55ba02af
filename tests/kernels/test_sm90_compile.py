"""The FP8 kernels and the MoE routing's compile for sm_90 (Hopper) on any machine: Triton's compiler and its bundled
ptxas run on the CPU. The interpreter tests run the kernels as Python and miss what only the
compiler rejects (an early return under a constexpr ``if`` passed them all and failed on the H200,
benchmarks section 41). Also checks the compiled code's shape: the TMA variants load their weight
tiles with bulk tensor copies, the pointer ones do not, and every in-block dot is an fp8 wgmma."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it on the CPU
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(ROOT / "dev" / "gpu" / "sm90_compile.py"), "--json"], env=env,
                         capture_output=True, text=True, timeout=600)
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert {name: r["error"] for name, r in results.items() if "error" in r} == {}
    assert len(results) == 13
    for name, r in results.items():
        assert (r["wgmma"] > 0) == r["wgmma_expected"], name
        assert (r["bulk_tensor_loads"] > 0) == r["tma_expected"], name
