"""The device-call scripts that build variant trees by sed (benchmarks/tree_variants.sh): every
edit still matches the tree (a stale one would fail the variant on the device, its call wasted).
Each script's DRY=1 builds its variants and runs ``bench --help`` in each, on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {"b1_probe.sh": ["main", "fp8t132", "fp8t66", "gemmk1024", "gemmk2048"],
           "long_ctx_probe.sh": ["main", "cpp8", "cpp2", "run32"]}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_variant_edit_still_applies(script):
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT), "DRY": "1",
           "HOME": os.environ.get("HOME", "/tmp")}
    out = subprocess.run(["bash", f"benchmarks/{script}"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rounds = [line.split()[3] for line in out.stdout.splitlines() if line.startswith("== round 1:")]
    assert rounds == SCRIPTS[script]
    assert out.stdout.count("usage: bi-engine bench") == len(SCRIPTS[script])
