"""``bi-engine serve``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

Two processes: this one runs the HTTP front (``app.py``: routes; ``server.py``: what they share;
``formats.py``, ``api_errors.py``: OpenAI formats and errors; ``openai_protocol.py``: request models;
``native.py``: SGLang's ``/generate``; ``control_routes.py`` and ``control_bodies.py``: the RL
control routes of vLLM and SGLang; ``router_routes.py``: what routers read; ``auth.py``: who may call which
route (docs/security.md); ``dev.py``: vLLM's dev-mode ``/collective_rpc``; ``metrics.py``:
Prometheus; ``client.py``: the engine process's handle), and the engine process runs the engine
loop (``loop.py``, its control calls in ``loop_control.py``), so HTTP work never holds the engine's
GIL; ``messages.py`` holds the messages between the two. Needs the ``serve`` extra:
``pip install "bi-engine[serve]"``."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from pathlib import Path

from bi_core.config import EngineConfig
from bi_core.errors import BiEngineError

# uvicorn's own limit on a graceful exit, beyond serve.shutdown_timeout_s: by then the engine has
# aborted what was left and every handler has answered, so uvicorn never cancels one (a cancelled
# handler answers a plain-text 500, or cuts its stream, and logs a traceback)
SHUTDOWN_GRACE_S = 10


def model_name_for(config: EngineConfig) -> str:
    """The id clients send as ``model``: serve.model_name, else the checkpoint directory's or the
    preset's name."""
    if config.serve.model_name:
        return config.serve.model_name
    if config.model.path:
        return Path(config.model.path).resolve().name
    return config.model.random.preset


def check_port(host: str, port: int) -> None:
    """Fail early, before the engine is built, when the address cannot be bound. Binds as uvicorn's
    server will (asyncio's create_server: every address of the host, SO_REUSEADDR so only a
    listening socket is in the way, IPv6 sockets IPv6-only), then lets go."""
    if port == 0:
        return
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError as e:
        raise BiEngineError(f"cannot serve on {host}:{port}: {e.strerror or e} (serve.host / serve.port, "
                            "--host / --port)") from None


def log_to_stderr() -> None:
    """The server's own lines (``bi_core.*``) in uvicorn's format, once."""
    logger = logging.getLogger("bi_core")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:  %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def note_control_guard(guard, where: str, log: logging.Logger | None = None) -> None:
    """Say at start what the control routes' rule (``auth.Guard``) makes of this address."""
    log = log or logging.getLogger("bi_core.serve")
    if guard.control_unguarded:
        log.warning("serve.allow_unauthenticated_control: the control routes (weight updates, sleep, pause, aborts, "
                    "...) of %s answer anyone who reaches %s without a key (docs/security.md)", where, guard.host)
    elif guard.control_refused:
        log.warning("%s listens on %s (beyond loopback) without an API key: its control routes answer 403 until "
                    "serve.admin_api_key or serve.api_key is set (or serve.allow_unauthenticated_control: true)",
                    where, guard.host)


def run_server(config: EngineConfig) -> int:
    """Start the engine process, serve until SIGTERM/SIGINT, then stop accepting, let in-flight
    requests finish within serve.shutdown_timeout_s, abort what is left (each answers an
    OpenAI-shaped error), stop the engine process and return 0. If the engine process dies, the
    log says how, in-flight requests answer an error and the server stops: a BiEngineError (a
    non-zero exit, for a supervisor to restart it)."""
    try:
        import uvicorn

        from bi_core.serve.app import create_app
    except ImportError as e:
        raise BiEngineError(f"bi-engine serve needs the serve extra (pip install 'bi-engine[serve]'): {e}") from None
    from bi_core.models.tokenizer import tokenizer_for
    from bi_core.runtime.threads import size_http_threads
    from bi_core.serve.auth import Guard
    from bi_core.serve.client import EngineClient
    from bi_core.serve.metrics import Metrics

    s = config.serve
    check_port(s.host, s.port)
    log_to_stderr()
    note_control_guard(Guard.of(s), "the server")
    size_http_threads()
    metrics = Metrics(model_name_for(config), config.model.max_model_len)
    core = EngineClient(config, metrics)  # returns once the engine is built and warmed up
    try:
        app = create_app(core, s, model_name_for(config), tokenizer_for(config.model), metrics, config.model.path,
                         media_root=config.vision.media_root)
        server = app.state.server

        class Uvicorn(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                """SIGTERM/SIGINT: refuse new work, start the engine's shutdown deadline, then uvicorn's
                graceful exit; unlike uvicorn's own, the signal is not raised again afterwards (we exit
                0 once everything stopped)."""
                def on_signal(sig, frame) -> None:
                    server.shutting_down = True
                    core.drain(s.shutdown_timeout_s)
                    self.handle_exit(sig, frame)

                previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

        uv = Uvicorn(uvicorn.Config(app, host=s.host, port=s.port, log_level="info", access_log=False,
                                    timeout_graceful_shutdown=int(s.shutdown_timeout_s) + SHUTDOWN_GRACE_S))

        def on_lost(why: str) -> None:  # the engine process died: in-flight requests have their errors; stop
            server.shutting_down = True
            uv.should_exit = True

        core.on_lost = on_lost
        try:
            uv.run()
        except SystemExit:  # uvicorn's exit when it cannot start (the port was taken since check_port)
            if uv.started:
                raise
    finally:  # uvicorn ended (shut down, or never started: port taken): end the engine process too
        core.stop(0.0)
    if not uv.started:
        raise BiEngineError(f"the HTTP server did not start on {s.host}:{s.port} (see the log above)")
    if core.lost:
        raise BiEngineError(f"{core.failure}; the server stopped")
    return 0
