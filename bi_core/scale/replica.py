"""One replica: a ``bi-engine serve`` process, started, watched and stopped by a Ray actor that
lives in the replica's placement-group bundle (so the process sees the bundle's GPUs: Ray sets
the actor's ``CUDA_VISIBLE_DEVICES``, and the process inherits it).

The server binds the node's IP address on a free port (the router and the control front reach it
from any node); its config arrives as a dict (the driver's file need not exist on this node) and
its output goes to a log file on this node, whose last lines come back when it dies."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bi_core.config import INVARIANT_ENV
from bi_core.ports import free_port
from bi_core.scale.processes import terminate

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the actor's process ends, so a killed actor (its
    node lost, the driver gone) leaves no server behind."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ReplicaProcess:
    """The actor's body (``ray.remote(ReplicaProcess)`` in ``placement.py``)."""

    def __init__(self, index: int, config: dict, api_key: str | None) -> None:
        self.index, self.api_key = index, api_key
        self.dir = Path(tempfile.mkdtemp(prefix=f"bi-engine-replica{index}-"))
        self.config_path = self.dir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.launches = 0

    def start(self) -> dict:
        """Launch the server (any earlier one must have ended); returns where it listens. Whether it
        came up is the caller's to see (``/health``, ``returncode``)."""
        import ray

        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"replica {self.index}: the server (pid {self.proc.pid}) is still running")
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        self.launches += 1
        self.log_path = self.dir / f"serve.{self.launches}.log"
        cmd = [sys.executable, "-m", "bi_core.cli", "serve", "--config", str(self.config_path), "--host", host,
               "--port", str(port)]
        if self.api_key is not None:
            cmd += ["--api-key", self.api_key]
        # the mode is the one the driver resolved (in the config): this node's environment has no say
        env = {k: v for k, v in os.environ.items() if k != INVARIANT_ENV}
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**env, "PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent)
        return {"url": f"http://{host}:{port}", "pid": self.proc.pid, "node": host, "log": str(self.log_path),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def returncode(self) -> int | None:
        """None while the server runs; its exit status once it ended (negative: killed by that signal)."""
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, num_lines: int = 8) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM (the server lets running requests finish within serve.shutdown_timeout_s), then
        SIGKILL after ``timeout_s``."""
        return None if self.proc is None else terminate(self.proc, timeout_s)
