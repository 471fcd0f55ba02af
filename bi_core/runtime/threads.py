"""Torch's CPU threads in the engine's processes; a user's OMP_NUM_THREADS always wins.

- The server on a CPU device: torch's default (a thread per core) in the engine process competes
  with the HTTP process for the same cores: on a machine shared with other work, concurrent
  requests ran many times slower than with OMP_NUM_THREADS=1 (the measurement is in the message of
  commit 55704a2, which added this module). So the engine process takes the cores it may run on
  but one (split between its ranks with tensor parallelism), the HTTP process one thread.
- A GPU engine, once built (its weights loaded: a load's CPU work keeps the default): one thread,
  as vLLM's processes run. Its OpenMP threads spun beside the launching thread, burning CPU for
  most of an eager prefill pass, where one thread burned none at the same wall time
  (dev/benchmarks-history.md)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's CPU set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def engine_threads(num_cores: int, num_ranks: int, env: Mapping[str, str]) -> int | None:
    """Torch threads per engine process on a CPU device: the cores but one (for the HTTP
    process), split between the ranks; None when the user set OMP_NUM_THREADS."""
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, (num_cores - 1) // num_ranks)


def size_engine_threads(config) -> None:
    """In the engine process, before the engine is built: size torch's thread pool (and, through
    OMP_NUM_THREADS, the tensor-parallel ranks it starts) and log the decision. A GPU engine sizes
    its own, once built (``size_gpu_engine_threads``)."""
    import torch

    from bi_core.policies.checks import planned_device

    if planned_device(config.model.device).type != "cpu":
        return
    cores, ranks = available_cores(), config.parallel.tensor_parallel_size
    n = engine_threads(cores, ranks, os.environ)
    if n is None:
        log.info("CPU threads: OMP_NUM_THREADS=%s kept (torch runs %d thread(s) per engine process)",
                 os.environ["OMP_NUM_THREADS"], torch.get_num_threads())
        return
    os.environ["OMP_NUM_THREADS"] = str(n)  # inherited by the ranks this process starts
    torch.set_num_threads(n)
    log.info("CPU threads: %d per engine process (%d rank(s)) of the %d cores available, one left for the HTTP "
             "process; set OMP_NUM_THREADS to choose", n, ranks, cores)


def size_gpu_engine_threads() -> None:
    """In a GPU engine's process, once the engine is built: one torch thread (the device computes;
    the host launches from one thread), unless the user set OMP_NUM_THREADS."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    if torch.get_num_threads() != 1:
        log.info("CPU threads: 1 in this GPU engine's process (was %d; their OpenMP threads spun beside the "
                 "launching one); set OMP_NUM_THREADS to choose", torch.get_num_threads())
        torch.set_num_threads(1)


def size_http_threads() -> None:
    """In the HTTP process: one torch thread (it formats responses; the engine process computes)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    torch.set_num_threads(1)
