"""``bi-engine serve``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn).

A layer above the engine: ``app.py`` (routes, OpenAI formats, errors), ``loop.py`` (the one
thread that owns the engine), ``protocol.py`` (request models), ``metrics.py`` (Prometheus).
Needs the ``serve`` extra: ``pip install "bi-engine[serve]"``."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from bi_core.config import EngineConfig
from bi_core.errors import BiEngineError


def model_name_for(config: EngineConfig) -> str:
    """The id clients send as ``model``: serve.model_name, else the checkpoint directory's or the
    preset's name."""
    if config.serve.model_name:
        return config.serve.model_name
    if config.model.path:
        return Path(config.model.path).resolve().name
    return config.model.random.preset


def run_server(config: EngineConfig) -> int:
    """Build the engine, serve until SIGTERM/SIGINT, then stop accepting, let in-flight requests
    finish within serve.shutdown_timeout_s (abort what is left) and return 0.

    The engine loop runs here, on the main thread that built the engine (see ``loop.py`` for why);
    uvicorn runs on a second thread, and the signals are caught here and handed to it."""
    try:
        import uvicorn

        from bi_core.serve.app import create_app
    except ImportError as e:
        raise BiEngineError(f"bi-engine serve needs the serve extra (pip install 'bi-engine[serve]'): {e}") from None
    from bi_core import build_engine

    engine = build_engine(config)
    app = create_app(engine, config.serve, model_name_for(config), loop_thread=False)
    server = app.state.server
    s = config.serve
    uv = uvicorn.Server(uvicorn.Config(app, host=s.host, port=s.port, log_level="info", access_log=False,
                                       timeout_graceful_shutdown=max(1, int(s.shutdown_timeout_s))))

    def on_signal(sig, frame) -> None:  # SIGTERM/SIGINT: refuse new work, then uvicorn's graceful exit
        server.shutting_down = True
        uv.handle_exit(sig, frame)

    def serve_http() -> None:
        try:
            uv.run()
        finally:  # uvicorn ended (shut down, or never started: port taken): end the engine loop too
            server.loop.stopping = True
            server.loop.deadline = time.monotonic()
            server.loop.wakeup.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    http = threading.Thread(target=serve_http, name="bi-engine-http", daemon=True)
    try:
        http.start()
        server.loop.run()
        http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not uv.started:
        raise BiEngineError(f"the HTTP server did not start on {s.host}:{s.port} (see the log above)")
    return 0
