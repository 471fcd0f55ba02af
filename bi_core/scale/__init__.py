"""Many replicas of one engine behind an existing router: ``bi-engine serve --data-parallel-size N``
(``parallel.data_parallel_size``) places N replicas with Ray (one placement-group bundle each: its
tensor-parallel GPUs, or one CPU), runs a lone ``bi-engine serve`` in each, puts sglang-router in
front of them, restarts a replica that dies (taking it out of the router meanwhile) and fans the
RL control routes out to every replica. Needs the ``scale`` extra (``pip install
'bi-engine[scale]'``: Ray and sglang-router); a lone server (N = 1) imports neither.

- ``options.py``: the flags, checked (``ScaleOptions``), and the extra's presence
- ``placement.py``: joining Ray, the placement group, one actor per bundle
- ``replica.py``: the actor's body: one ``bi-engine serve`` process, started, watched, stopped
- ``router.py``: the sglang-router process and its worker API
- ``processes.py``: a free port, a bounded stop (the router's and the replicas' processes)
- ``supervisor.py``: the replicas' states and the thread that replaces dead ones
- ``fanout.py``, ``front.py``: control calls to every replica, and the app that serves them
- ``deployment.py``: all of it started, served until a signal, stopped
"""

from __future__ import annotations

from bi_core.config import EngineConfig
from bi_core.scale.options import ROUTER_POLICIES, ScaleOptions, check_installed

__all__ = ["ROUTER_POLICIES", "ScaleOptions", "check_installed", "run_replicas"]


def run_replicas(config_path: str, config: EngineConfig, options: ScaleOptions) -> int:
    """Serve ``config`` as ``options.data_parallel_size`` replicas until SIGTERM/SIGINT; 0 once
    everything stopped."""
    check_installed()
    from bi_core.scale.deployment import run

    return run(config_path, config, options)
