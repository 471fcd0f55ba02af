"""Compile-ahead on the GPU (``runtime/compile_ahead.py``), each step in a process of its own with
an empty Triton cache: a manifest recorded from a kernel's launch, replayed in a fresh process,
leaves nothing to compile (nor a C launcher to build) at that launch and gives a plain run's
bits; without the replay, or with the entry's recorded hash changed, the launch compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

# argv: step (record | replay | stale | plain), manifest path, output path (JSON; the tensor at .pt)
STEP = r'''
import json, sys
import attrs, torch, triton
import triton.runtime.build as build
from triton import knobs
from bi_core.kernels.norm import rms_norm
from bi_core.runtime import compile_ahead, compile_manifest

step, manifest, out = sys.argv[1:]
capability = "sm%d%d" % torch.cuda.get_device_capability()
fields = {"backend": "test", "capability": capability, "triton": triton.__version__}
torch.manual_seed(0)
x = torch.randn(37, 2048, device="cuda", dtype=torch.bfloat16)
w = 0.1 * torch.randn(2048, device="cuda", dtype=torch.bfloat16)
result = {}
if step == "record":
    with compile_manifest.recording() as rec:
        y = rms_norm(x, w, 1e-6)
    compile_manifest.write_manifest(manifest, fields, rec.entries())
    result["unrecorded"] = rec.unrecorded
if step in ("replay", "stale"):
    entries = compile_manifest.read_entries(manifest, fields)
    if step == "stale":
        entries[0]["hash"] = "0" * 64
    ahead = compile_ahead.CompileAhead()
    ahead.launch(entries, torch.cuda.current_device())
    result["report"] = attrs.asdict(ahead.join())
compiles, c_builds = [], []
knobs.runtime.jit_post_compile_hook = lambda **call: compiles.append(call["fn"].name)
if hasattr(build, "_build"):  # Triton 3.6 builds each kernel's C launcher with gcc at its first launch
    plain_build = build._build
    build._build = lambda *a, **k: c_builds.append(a[0]) or plain_build(*a, **k)
if step != "record":
    y = rms_norm(x, w, 1e-6)
torch.cuda.synchronize()
result.update(compiles=compiles, c_builds=c_builds)
torch.save(y.cpu(), out + ".pt")
with open(out, "w") as f:
    json.dump(result, f)
'''


def run_step(tmp: Path, step: str, manifest: Path) -> tuple[dict, torch.Tensor]:
    cache = tmp / f"triton_cache_{step}"
    cache.mkdir()
    out = tmp / f"{step}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "BI_COMPILE_AHEAD")}
    env.update(TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", STEP, step, str(manifest), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), torch.load(f"{out}.pt")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile_ahead")
    manifest = tmp / "manifest.json"
    result, y = run_step(tmp, "record", manifest)
    plain, y_plain = run_step(tmp, "plain", manifest)
    return tmp, manifest, result, y, plain, y_plain


def test_the_recording_writes_down_the_launched_kernel(recorded):
    _, manifest, result, _, _, _ = recorded
    doc = json.loads(manifest.read_text())
    assert result["unrecorded"] == 0
    assert [e["kernel"] for e in doc["entries"]] == ["bi_core.kernels.norm:_rms_norm_kernel"]
    assert "extern_libs" not in doc["entries"][0]["spec"]["options"]  # this machine's libdevice path


def test_a_replayed_manifest_leaves_nothing_to_compile_at_launch(recorded):
    tmp, manifest, _, y_recorded, plain, y_plain = recorded
    assert plain["compiles"] == ["_rms_norm_kernel"]  # negative control: no replay, one compile at launch
    result, y = run_step(tmp, "replay", manifest)
    assert result["report"]["entries"] == 1 and result["report"]["compiled"] == 1, result
    assert result["compiles"] == [] and result["c_builds"] == [], result
    assert torch.equal(y, y_plain) and torch.equal(y, y_recorded)


def test_an_entry_that_would_not_compile_to_its_recorded_hash_is_not_installed(recorded):
    tmp, manifest, _, _, _, y_plain = recorded
    result, y = run_step(tmp, "stale", manifest)
    assert result["report"]["stale"] == 1 and result["report"]["compiled"] == 0, result
    assert result["compiles"] == ["_rms_norm_kernel"]
    assert torch.equal(y, y_plain)
