"""How fla's Triton kernels get their launch configs (the chunked GDN prefill, both CUDA backends).

- Invariant mode pins every autotuner to its first candidate: no config is chosen by timing,
  which could differ between processes and with it the bits (``pin_first``).
- Default mode runs what fla's autotuners chose on this GPU family, recorded once and shipped as
  ``fla_configs/sm<major><minor>.json`` (``pin_recorded``): a fresh machine compiles one config
  per kernel instead of compiling and timing every candidate (issue 22: with an empty Triton cache
  the timing and the candidates' compiles were most of a start; dev/benchmarks-history.md).
  Whatever the table does not cover autotunes as fla does, with the choice kept on disk in the
  Triton cache directory (``cache_on_disk``).

Record a table with ``python3 benchmarks/start_time.py CONFIG --record-fla PATH`` on an empty
Triton cache (``TRITON_CACHE_DIR``); ``record`` lists what the autotuners chose by timing."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

TABLES = Path(__file__).with_name("fla_configs")
# what ``gdn.chunk_rule`` calls: imported before each scan, so that every autotuner it runs is found
MODULES = ("fla.modules.norm.l2norm", "fla.ops.common.chunk_delta_h", "fla.ops.common.chunk_o",
           "fla.ops.gated_delta_rule.chunk_fwd", "fla.ops.utils.cumsum", "fla.ops.gated_delta_rule")


def autotuners():
    """Every Triton autotuner of the fla modules imported (``MODULES`` first), each once."""
    from triton.runtime.autotuner import Autotuner

    for name in MODULES:
        importlib.import_module(name)
    seen = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in vars(module).values():
            target = obj
            while target is not None and not isinstance(target, Autotuner):
                target = getattr(target, "fn", None) if not isinstance(target, type) else None
            if isinstance(target, Autotuner) and id(target) not in seen:
                seen.add(id(target))
                yield target


def kernel_name(tuner) -> str:
    return tuner.base_fn.__name__


# Pins are process-wide (fla's autotuners are module globals). Once an invariant engine pinned its
# configs, a default engine built later in the same process keeps them: replacing them would
# change the invariant engine's bits from then on.
_invariant_pinned = False


def candidates(tuner) -> list:
    """The tuner's own candidates as fla declared them, saved before any pin replaced them."""
    if "_bi_candidates" not in vars(tuner):
        tuner._bi_candidates = list(tuner.configs)
    return tuner._bi_candidates


def pin_first() -> int:
    """Make every fla autotuner's first declared config its only candidate, so no kernel config is
    chosen by timing (whatever was pinned before). Returns how many were pinned."""
    global _invariant_pinned
    _invariant_pinned = True
    pinned = 0
    for tuner in autotuners():
        if len(candidates(tuner)) > 1:
            tuner.configs = candidates(tuner)[:1]
            pinned += 1
    return pinned


def cache_on_disk() -> int:
    """Let every fla autotuner keep its choices on disk (Triton's ``cache_results``, in the Triton
    cache directory), so only the first start on a machine times what no table covers. Returns
    how many tuners it set."""
    count = 0
    for tuner in autotuners():
        if hasattr(tuner, "cache_results"):  # Triton >= 3.2
            tuner.cache_results = True
            count += 1
    return count


def config_fields(cfg) -> dict:
    """A Triton config as JSON: what distinguishes two candidates of one autotuner."""
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None)}


def record() -> dict[str, list[dict]]:
    """What every fla autotuner with several candidates chose so far, per kernel: a list of
    ``{"key": [...], "config": {...}}`` (Triton's tuning key: the key arguments, then the dtypes)."""
    table: dict[str, list[dict]] = {}
    for tuner in autotuners():
        if len(tuner.configs) > 1 and tuner.cache:  # chose by timing (not pinned)
            table[kernel_name(tuner)] = [{"key": list(key), "config": config_fields(cfg)}
                                         for key, cfg in sorted(tuner.cache.items(), key=lambda kv: repr(kv[0]))]
    return table


def pin_recorded(kernels: dict[str, list[dict]]) -> list[str]:
    """Each fla autotuner named in ``kernels`` (``record``'s form) runs the recorded choices without
    timing: one distinct choice becomes its only candidate (any key); several fill its cache by
    key (keys not recorded time as before). A choice that is not among the tuner's own candidates
    (a table from another fla version) leaves that kernel autotuning. Nothing is pinned once an
    invariant engine pinned first configs in this process. Returns the kernels pinned."""
    pinned = []
    if _invariant_pinned:
        return pinned
    for tuner in autotuners():
        entries = kernels.get(kernel_name(tuner))
        if not entries or len(candidates(tuner)) < 2:
            continue
        own = {json.dumps(config_fields(c), sort_keys=True): c for c in candidates(tuner)}
        chosen = [own.get(json.dumps(e["config"], sort_keys=True)) for e in entries]
        if any(c is None for c in chosen):
            continue
        if len({id(c) for c in chosen}) == 1:
            tuner.configs = [chosen[0]]
        else:
            tuner.configs = candidates(tuner)
            tuner.cache.update({tuple(e["key"]): c for e, c in zip(entries, chosen)})
        pinned.append(kernel_name(tuner))
    return pinned


def table_path(capability: tuple[int, int]) -> Path:
    return TABLES / f"sm{capability[0]}{capability[1]}.json"


def pin_for_device(capability: tuple[int, int]) -> list[str]:
    """``pin_recorded`` with the table shipped for this compute capability, if there is one."""
    path = table_path(capability)
    if not path.exists():
        return []
    return pin_recorded(json.loads(path.read_text())["kernels"])
