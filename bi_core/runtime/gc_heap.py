"""The start's objects live as long as the engine: keep the cyclic GC from walking them.

After a start a process holds the objects of the weights, the captured graphs, the op plans and
every compiled Triton kernel (hundreds of thousands of tracked objects on the larger models), and
Python's oldest-generation collections walk all of them every time they run. ``freeze`` at the end
of the warm-up collects once and moves what exists then out of the GC's reach, as vLLM and SGLang
do after their start. (Processes whose start had compiled their kernels ran a large-batch decode
host-bound; after this change they did not. That the GC was the cause is likely, not shown:
dev/benchmarks-history.md.)
Frozen objects are still freed by reference counting; only reference cycles among them wait for
``collect``, which the places that drop whole engines or graphs call."""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()


def collect(refreeze: bool = False) -> None:
    """Collect everything, frozen objects included (an engine or its graphs were dropped and may
    sit in reference cycles); ``refreeze``: then exempt the survivors again, without a second
    pass."""
    gc.unfreeze()
    gc.collect()
    if refreeze:
        gc.freeze()
