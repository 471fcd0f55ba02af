"""The start's objects are frozen out of the cyclic GC (``runtime/gc_heap.py``); the places that
drop an engine or its graphs must still get back what sits in reference cycles."""

from __future__ import annotations

import gc
import weakref

from bi_core.runtime import gc_heap


class _Node:
    pass


def _cycle() -> _Node:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


def test_frozen_cycles_wait_for_collect_not_for_gc_collect():
    try:
        engine = _cycle()  # alive at the freeze, as an engine is at the end of its warm-up
        ref = weakref.ref(engine)
        gc_heap.freeze()
        assert gc.get_freeze_count() > 0
        del engine  # dropped: only the cyclic GC can free it now
        gc.collect()
        assert ref() is not None  # negative control: a plain collection skips the frozen heap
        gc_heap.collect()
        assert ref() is None
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_collect_can_refreeze_the_survivors():
    try:
        keep = _Node()
        keep.self = keep
        gc_heap.collect(refreeze=True)
        assert gc.get_freeze_count() > 0
        ref = weakref.ref(_cycle())
        gc.collect()
        assert ref() is None  # objects made after the freeze are collected as usual
        del keep
    finally:
        gc.unfreeze()
