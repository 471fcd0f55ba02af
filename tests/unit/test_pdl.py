"""Programmatic dependent launch: every launch asks for it where it is supported (one compiled
variant per kernel), and only launches inside ``early_launch(True)`` let their successor start
early (a runtime bool, so no second variant either)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_pdl_on_every_launch_early_only_inside_the_scope(monkeypatch):
    from bi_core.kernels import common

    monkeypatch.setattr(common, "_pdl_supported", False)
    with common.early_launch(True):  # no SM90 (or BI_PDL=0, or the interpreter): plain launches
        assert common.pdl() == {"PDL": False, "pdl_early": False}
    monkeypatch.setattr(common, "_pdl_supported", True)
    assert common.pdl() == {"PDL": True, "launch_pdl": True, "pdl_early": False}
    with common.early_launch(True):
        assert common.pdl() == {"PDL": True, "launch_pdl": True, "pdl_early": True}
        with common.early_launch(False):
            assert common.pdl()["pdl_early"] is False
        assert common.pdl()["pdl_early"] is True
    assert common.pdl()["pdl_early"] is False


def test_the_early_flag_is_a_bool_so_triton_compiles_no_variant_for_it():
    """Triton specializes an int argument on its value (1, divisible by 16), a bool on nothing:
    passing 0/1 would compile every kernel twice again."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    if not hasattr(libtriton, "native_specialize_impl"):
        pytest.skip("this Triton specializes in Python")
    from triton.backends.compiler import BaseBackend

    native_specialize_impl = libtriton.native_specialize_impl

    def spec(value):
        try:
            return native_specialize_impl(BaseBackend, value, False, True, True)
        except TypeError:
            pytest.skip("native_specialize_impl's signature changed in this Triton")

    assert spec(True) == spec(False)
    assert spec(0) != spec(1)  # negative control: an int argument would be two variants


def test_pdl_off_under_the_interpreter_or_by_env(monkeypatch):
    from bi_core.kernels import common

    monkeypatch.setattr(common, "_pdl_supported", None)
    monkeypatch.setenv("BI_PDL", "0")
    assert not common._supported()
