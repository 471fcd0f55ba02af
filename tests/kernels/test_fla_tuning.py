"""fla's launch configs in the default backend (issue 22's start time): a recorded table pins each
autotuner to the candidate chosen on that GPU family, so a fresh start compiles one config per
kernel and times none. The autotuners here are stand-ins put where fla's modules would be."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from bi_core.backends.cuda_common import fla_tuning

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=1) for b in (16, 32) for w in (2, 4)]


@triton.jit
def _double_kernel(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * 2, mask=offs < n)


def _tuner() -> Autotuner:
    return triton.autotune(configs=list(CONFIGS), key=["n"])(_double_kernel)


@pytest.fixture
def fake_fla(monkeypatch):
    """fla's modules as empty stand-ins; returns a function that puts a fresh autotuner in one."""
    monkeypatch.setattr(fla_tuning, "_invariant_pinned", False)
    for name in fla_tuning.MODULES:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))

    def install() -> Autotuner:
        tuner = _tuner()
        sys.modules["fla.ops.common.chunk_o"].kernel = tuner
        return tuner
    return install


def _round_trip(table):
    return json.loads(json.dumps(table))


def test_a_recorded_choice_becomes_the_only_candidate(fake_fla):
    timed = fake_fla()
    timed.cache[(64, "torch.float32", "torch.float32")] = CONFIGS[1]  # what timing chose
    table = _round_trip(fla_tuning.record())
    assert list(table) == ["_double_kernel"]
    fresh = fake_fla()  # the next process
    assert fla_tuning.pin_recorded(table) == ["_double_kernel"]
    assert fresh.configs == [CONFIGS[1]]


def test_several_choices_fill_the_cache_by_key(fake_fla):
    timed = fake_fla()
    keys = [(64, "torch.float32", "torch.float32"), (4096, "torch.float32", "torch.float32")]
    timed.cache.update({keys[0]: CONFIGS[0], keys[1]: CONFIGS[3]})
    table = _round_trip(fla_tuning.record())
    fresh = fake_fla()
    assert fla_tuning.pin_recorded(table) == ["_double_kernel"]
    assert len(fresh.configs) == len(CONFIGS)  # keys not recorded still time
    assert fresh.cache == {keys[0]: CONFIGS[0], keys[1]: CONFIGS[3]}


def test_a_choice_that_is_not_a_candidate_is_skipped(fake_fla):
    tuner = fake_fla()
    other = fla_tuning.config_fields(triton.Config({"BLOCK": 64}, num_warps=16, num_stages=1))
    assert fla_tuning.pin_recorded({"_double_kernel": [{"key": [64], "config": other}]}) == []
    assert tuner.configs == CONFIGS and not tuner.cache


def test_an_invariant_pin_holds_whatever_else_the_process_builds(fake_fla):
    """An invariant engine's first configs do not depend on what a default engine pinned before or
    after it in the same process (its bits would). Negative control: slicing the current candidates,
    as pinning did before the table, keeps the table's choice."""
    table = {"_double_kernel": [{"key": [40], "config": fla_tuning.config_fields(CONFIGS[2])}]}
    tuner = fake_fla()
    assert fla_tuning.pin_recorded(table) == ["_double_kernel"]  # a default engine first
    assert tuner.configs[:1] == [CONFIGS[2]]  # what slicing would keep
    fla_tuning.pin_first()  # then an invariant engine
    assert tuner.configs == [CONFIGS[0]]
    assert fla_tuning.pin_recorded(table) == [] and tuner.configs == [CONFIGS[0]]  # a default engine after it


def test_a_pinned_kernel_runs_without_timing(fake_fla, monkeypatch, device):
    """The pinned autotuner runs its kernel at once; the same autotuner unpinned times its candidates
    (negative control: the stand-in timer raises)."""
    def no_timing(*args, **kwargs):
        raise AssertionError("timed a candidate")
    monkeypatch.setattr(Autotuner, "_bench", no_timing)
    x = torch.arange(40, dtype=torch.float32, device=device)
    unpinned = fake_fla()
    with pytest.raises(AssertionError, match="timed a candidate"):
        unpinned[lambda meta: (triton.cdiv(40, meta["BLOCK"]),)](x, torch.empty_like(x), 40)
    pinned = fake_fla()
    fla_tuning.pin_recorded({"_double_kernel": [{"key": [40], "config": fla_tuning.config_fields(CONFIGS[2])}]})
    y = torch.empty_like(x)
    pinned[lambda meta: (triton.cdiv(40, meta["BLOCK"]),)](x, y, 40)
    assert torch.equal(y, 2 * x)


def test_shipped_tables_are_well_formed():
    """Every shipped table names its GPU family in its file name and holds, per kernel, keys and
    complete configs; with fla installed, each chosen config is one of that kernel's candidates."""
    tables = sorted(fla_tuning.TABLES.glob("*.json"))
    assert tables, "no fla config table shipped"
    for path in tables:
        table = json.loads(path.read_text())
        assert path == fla_tuning.table_path(tuple(table["capability"]))
        assert table["kernels"]
        for entries in table["kernels"].values():
            for e in entries:
                assert isinstance(e["key"], list)
                assert set(e["config"]) == {"kwargs", "num_warps", "num_stages", "num_ctas", "maxnreg"}
    if fla_tuning_importable():
        tuners = {fla_tuning.kernel_name(t): t for t in fla_tuning.autotuners()}
        for path in tables:
            for name, entries in json.loads(path.read_text())["kernels"].items():
                own = [fla_tuning.config_fields(c) for c in fla_tuning.candidates(tuners[name])]
                assert all(e["config"] in own for e in entries), name


def fla_tuning_importable() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True
