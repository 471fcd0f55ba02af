"""Programmatic dependent launch: which launches ask for it, and only those carry the wait."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_pdl_only_inside_a_scope_and_only_where_supported(monkeypatch):
    from bi_core.kernels import common

    monkeypatch.setattr(common, "_pdl_supported", False)
    with common.pdl_scope(True):
        assert common.pdl() == {"PDL": False}  # no SM90 (or BI_PDL=0, or the interpreter): plain launches
    monkeypatch.setattr(common, "_pdl_supported", True)
    assert common.pdl() == {"PDL": False}  # outside a scope: the variant without the wait, a plain launch
    with common.pdl_scope(True):
        assert common.pdl() == {"PDL": True, "launch_pdl": True}
        with common.pdl_scope(False):
            assert common.pdl() == {"PDL": False}
        assert common.pdl()["launch_pdl"]
    assert common.pdl() == {"PDL": False}


def test_pdl_off_under_the_interpreter_or_by_env(monkeypatch):
    from bi_core.kernels import common

    monkeypatch.setattr(common, "_pdl_supported", None)
    monkeypatch.setenv("BI_PDL", "0")
    assert not common._supported()
