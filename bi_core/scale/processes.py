"""Child processes of the deployment (the router, each replica's server): a bounded stop (their
ports: ``bi_core.ports``)."""

from __future__ import annotations

import subprocess


def terminate(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM (a server lets its running requests finish), SIGKILL after ``timeout_s``; the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
