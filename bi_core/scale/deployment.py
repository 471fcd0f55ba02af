"""``bi-engine serve --data-parallel-size N``: place N replicas with Ray, start them, put
sglang-router in front (``serve.host:serve.port``), watch them (``supervisor.py``) and serve the
control front (``serve.host:--control-port``) until SIGTERM/SIGINT; then stop the router (in-flight
requests finish within serve.shutdown_timeout_s), the replicas (likewise) and leave Ray (the
placement group and the actors belong to this job: Ray frees them when it ends). Every step of
the stop is bounded: a signal sent to the whole process group (Ctrl-C, systemd) also ends the Ray
processes this one started, so Ray may be gone by then."""

from __future__ import annotations

import contextlib
import logging
import secrets
import signal
import sys
import tempfile
from pathlib import Path

import ray
import uvicorn

from bi_core.config import EngineConfig, ServeConfig
from bi_core.errors import BiEngineError
from bi_core.scale import placement
from bi_core.scale.front import ControlFront, create_front
from bi_core.scale.options import ScaleOptions
from bi_core.scale.router import RouterProcess
from bi_core.scale.supervisor import Supervisor
from bi_core.serve import check_port, note_control_guard
from bi_core.serve.auth import Guard

log = logging.getLogger("bi_core.scale")


class _Stopped(Exception):
    """SIGTERM/SIGINT before the control front took over the signals."""


def _raise_stop(sig, frame) -> None:
    raise _Stopped


class _Front(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """SIGTERM/SIGINT end the front; unlike uvicorn's own, the signal is not raised again after
        (the deployment stops everything and exits 0)."""
        previous = {sig: signal.signal(sig, lambda s, f: self.handle_exit(s, f))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _log_to_stderr() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:  [replicas] %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def run(config_path: str, config: EngineConfig, options: ScaleOptions) -> int:
    s, n = config.serve, options.data_parallel_size
    if s.port == 0:
        raise BiEngineError("serve.port: 0 (any free port) cannot be used with data_parallel_size > 1: clients need "
                            "the router's port; give one (--port)")
    control_port = options.control_port if options.control_port is not None else s.port + 1
    if control_port == s.port:
        raise BiEngineError(f"--control-port: {control_port} is the router's port (--port); give another")
    check_port(s.host, s.port)
    check_port(s.host, control_port)
    replica_config = placement.replica_config(config_path, config)  # before Ray starts: a bad path fails fast
    replica_key = replica_control_key(s, replica_config)
    guard = Guard.of(s)
    _log_to_stderr()
    note_control_guard(guard, "the control front", log)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    supervisor = router = None
    try:
        placement.connect(options.ray_address)
        group = placement.place(config, n, options.startup_timeout_s)

        def spawn(index: int):
            return placement.spawn(group, index, replica_config, s.api_key)

        router_args = options.router_args
        if "--shutdown-grace-period-secs" not in router_args:
            router_args = (*router_args, "--shutdown-grace-period-secs", str(int(s.shutdown_timeout_s)))
        log_dir = Path(tempfile.mkdtemp(prefix="bi-engine-router-"))
        router = RouterProcess(s.host, s.port, options.router_policy, s.api_key, router_args, log_dir / "router.log")
        supervisor = Supervisor([spawn(i) for i in range(n)], spawn, router, s.api_key, options.poll_interval_s,
                                options.startup_timeout_s)
        log.info("starting %d replicas (tensor_parallel_size %d each)", n, config.parallel.tensor_parallel_size)
        urls = supervisor.start_all()
        router.start(urls, options.startup_timeout_s)
        supervisor.watch()
        front = ControlFront(supervisor, config.parallel.tensor_parallel_size, guard, replica_key, router.url)
        log.info("router on http://%s:%d (generation), control on http://%s:%d (fanned out to every replica)",
                 s.host, s.port, s.host, control_port)
        server = _Front(uvicorn.Config(create_front(front), host=s.host, port=control_port, log_level="warning",
                                       access_log=False))
        try:
            server.run()
        except SystemExit:  # uvicorn's exit when it cannot bind (the port was taken since check_port)
            if server.started:
                raise
        if not server.started:
            raise BiEngineError(f"the control front did not start on {s.host}:{control_port} (see the log above)")
    except _Stopped:
        log.info("stopping (signal received while starting)")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(supervisor, router, s.shutdown_timeout_s)
    return 0


def replica_control_key(s: ServeConfig, replica_config: dict) -> str | None:
    """The key the control front sends the replicas. They listen on their node's address (beyond
    loopback), so their control routes need one: serve.admin_api_key or serve.api_key when set,
    else one made here for this deployment (written into their config, never on a command line),
    which only the front knows."""
    if s.admin_api_key is not None or s.api_key is not None:
        return s.admin_api_key or s.api_key
    key = secrets.token_urlsafe(32)
    replica_config["serve"] = {**(replica_config.get("serve") or {}), "admin_api_key": key}
    return key


def _stop(supervisor: Supervisor | None, router: RouterProcess | None, timeout_s: float) -> None:
    """Router first (no new requests reach the replicas), then the replicas, then leave Ray."""
    if router is not None:
        router.stop(timeout_s + 10)
    if supervisor is not None:
        supervisor.stop(timeout_s)
    if ray.is_initialized():
        ray.shutdown()
    log.info("stopped")
