"""dev/gpu/tree_variants.sh: each variant's bench runs that variant's bi_core (not the working
directory's), in the order given, and a sed that changes nothing fails the variant."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "bi_core/cli.py|s/override policy.batch_invariant/VARIANT-MARK policy.batch_invariant/"


def _run(*variants: str) -> subprocess.CompletedProcess:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", "dev/gpu/tree_variants.sh", "1", *variants, "--", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_each_variant_runs_its_own_tree_in_order():
    out = _run("here=.", f"marked={MARK}")
    assert out.returncode == 0, out.stdout + out.stderr
    announced, runs = out.stdout.split("== round 1: here")  # the variants' edits are echoed first
    assert "variant marked: >" in announced and "VARIANT-MARK" in announced
    here, marked = runs.split("== round 1: marked")
    assert "usage: bi-engine bench" in here and "VARIANT-MARK" not in here
    assert "usage: bi-engine bench" in marked and "VARIANT-MARK" in marked


def test_a_sed_that_changes_nothing_fails_the_variant():
    out = _run("stale=bi_core/cli.py|s/no such text anywhere//")
    assert out.returncode == 1 and "changed nothing in bi_core/cli.py" in out.stdout
    assert "== round" not in out.stdout  # nothing was run
