"""A free TCP port to give a child process or a process group: one mechanism for the deployment's
servers (``scale``) and the tensor-parallel ranks' rendezvous (``parallel``)."""

from __future__ import annotations

import socket

_given: set[tuple[str, int]] = set()  # ports this process handed out (each one given once)


def free_port(host: str = "127.0.0.1") -> int:
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
