"""Child processes of the deployment (the router, each replica's server): a free port to give one,
and a bounded stop."""

from __future__ import annotations

import socket
import subprocess


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
