"""Programmatic dependent launch: every launch asks for it where it is supported, none elsewhere."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_pdl_on_every_launch_only_where_supported(monkeypatch):
    from bi_core.kernels import common

    monkeypatch.setattr(common, "_pdl_supported", False)
    assert common.pdl() == {"PDL": False}  # no SM90 (or BI_PDL=0, or the interpreter): plain launches
    monkeypatch.setattr(common, "_pdl_supported", True)
    # one variant per kernel: the wait compiled in and the PDL launch, whatever the step (launch_pdl
    # is a compile option: two launch kinds would compile every kernel twice)
    assert common.pdl() == {"PDL": True, "launch_pdl": True}


def test_pdl_off_under_the_interpreter_or_by_env(monkeypatch):
    from bi_core.kernels import common

    monkeypatch.setattr(common, "_pdl_supported", None)
    monkeypatch.setenv("BI_PDL", "0")
    assert not common._supported()
