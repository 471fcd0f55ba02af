"""Child processes of the deployment (the router, each replica's server): a free port to give one,
and a bounded stop."""

from __future__ import annotations

import socket
import subprocess

_given: set[tuple[str, int]] = set()  # ports this process handed out (each one given once)


def free_port(host: str) -> int:
    """A port free on ``host`` now, never one this process gave before: the OS may hand the same
    ephemeral port to two binds in a row once the first socket is closed (two ports picked one after
    the other for the router and the control app came out equal in a CI run)."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if (host, port) not in _given:
            _given.add((host, port))
            return port


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
