"""``runtime/kernel_keys.py``: a kernel's Triton cache key does not depend on the order a process
keys its kernels in. Each case runs in a fresh process (keys are cached on the functions), with
Triton <= 3.6's ``DependenciesFinder._update_hash`` (a callee's globals merged before its key is
computed) put in place where the installed Triton has the fixed order: that is the GPU image's
Triton, whose manifests went stale (benchmarks section 45). The processes compile nothing; they
run without ``TRITON_INTERPRET`` (CI sets it), whose kernels have no cache keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, sys
import triton.runtime.jit as jit

def update_hash_triton36(self, func):  # Triton 3.5/3.6: merge first, then the callee's key
    self.used_global_vals.update(func.used_global_vals)
    func_key = func.cache_key
    func_key += str(getattr(func, "noinline", False))
    self.hasher.update(func_key.encode("utf-8"))

jit.DependenciesFinder._update_hash = update_hash_triton36
from bi_core.kernels import fp8, norm
from bi_core.runtime import kernel_keys
order, how = sys.argv[1], sys.argv[2]
if how == "callees":
    import triton.language as tl
    from bi_core.kernels import e4m3
    functions = kernel_keys.kernel_functions()
    print(json.dumps([e4m3.quant_group in kernel_keys.callees(norm._rms_norm_kernel),
                      e4m3.quant_group in kernel_keys.callees(fp8._quant_kernel),
                      e4m3.round_e4m3 in kernel_keys.callees(e4m3.quant_group),
                      kernel_keys._jit(tl.sum) in kernel_keys.callees(norm._rms_norm_kernel),  # tl.sum(...)
                      norm._rms_norm_kernel in functions and e4m3.quant_group in functions]))
    sys.exit()
first, second = (norm._rms_norm_kernel, fp8._quant_kernel) if order == "norm" else (fp8._quant_kernel, norm._rms_norm_kernel)
if how == "settle":
    kernel_keys.settle()
elif how == "callers":  # the two kernels alone, in this order: their helper reached only through them
    kernel_keys.settle_functions([first, second])
first.cache_key, second.cache_key
print(json.dumps({"norm": norm._rms_norm_kernel.cache_key, "quant": fp8._quant_kernel.cache_key}))
'''


def _keys(order: str, how: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, order, how], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_order_changes_keys_without_settle():
    """The negative control: with Triton 3.6's merge order, whichever of the two kernels that share
    ``e4m3.quant_group`` is keyed first gets another key."""
    norm_first, quant_first = _keys("norm", "plain"), _keys("quant", "plain")
    assert norm_first["norm"] != quant_first["norm"]
    assert norm_first["quant"] != quant_first["quant"]


def test_settle_gives_one_key_whatever_the_order():
    """``settle`` (every kernel module) and ``settle_functions`` on the two kernels alone, callers
    listed first: the same keys in both orders, those a kernel keyed after its helper gets (all
    the helper's globals in it)."""
    canonical = {"norm": _keys("quant", "plain")["norm"], "quant": _keys("norm", "plain")["quant"]}
    for order in ("norm", "quant"):
        assert _keys(order, "settle") == canonical
        assert _keys(order, "callers") == canonical


def test_callees_by_name_and_through_modules():
    """By name (``quant_group``), through a module (``tl.sum``), and every kernel module's functions."""
    assert _keys("-", "callees") == [True] * 5
