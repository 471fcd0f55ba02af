"""The router in front of the replicas: sglang-router (the SGLang Model Gateway, Rust), run as it
is released (``python -m sglang_router.launch_router``), and the part of its API the supervisor
uses: ``GET /workers`` (each worker's ``id``, ``url``, ``is_healthy``), ``POST /workers``
``{"url", "api_key"}`` and ``DELETE /workers/{id}`` (both queued by the router and done within
moments). Clients send their requests to it; it forwards ``/v1/completions``,
``/v1/chat/completions`` and ``/generate`` to a worker chosen by its policy, retrying another one
when a worker fails (a dead worker's connection error is retried)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bi_core.errors import BiEngineError
from bi_core.ports import free_port
from bi_core.scale.processes import terminate

log = logging.getLogger("bi_core.scale")


class RouterProcess:
    """One sglang-router process, routing to the replicas' URLs."""

    def __init__(self, host: str, port: int, policy: str, api_key: str | None, extra_args: tuple[str, ...],
                 log_path: Path) -> None:
        self.host, self.port, self.policy, self.api_key = host, port, policy, api_key
        self.extra_args, self.log_path = list(extra_args), log_path
        self.url = f"http://{host}:{port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self.proc: subprocess.Popen | None = None

    def start(self, urls: list[str], timeout_s: float) -> None:
        """Launch it with these workers and wait until it has all of them, healthy."""
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host, "--port", str(self.port),
               "--policy", self.policy, "--log-level", "warn", "--worker-urls", *urls]
        if "--prometheus-port" not in self.extra_args:  # its default (29000) would collide with a second router
            cmd += ["--prometheus-port", str(free_port(self.host))]
        if self.api_key is not None:  # clients' key at the router; also what it sends the workers it discovers
            cmd += ["--api-key", self.api_key]
        with self.log_path.open("a") as out:
            self.proc = subprocess.Popen([*cmd, *self.extra_args], stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._has(urls):
            if self.proc.poll() is not None:
                raise BiEngineError(f"sglang-router exited with status {self.proc.returncode} at start: "
                                    f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop(5.0)
                raise BiEngineError(f"sglang-router did not report the {len(urls)} replicas healthy within "
                                    f"{timeout_s:g} s (log: {self.log_path})")
            time.sleep(0.2)
        log.info("sglang-router (policy %s) on %s routes to %s", self.policy, self.url, ", ".join(urls))

    def _has(self, urls: list[str]) -> bool:
        try:
            healthy = {w["url"] for w in self.workers() if w.get("is_healthy")}
        except (httpx.HTTPError, BiEngineError):
            return False
        return set(urls) <= healthy

    def workers(self) -> list[dict]:
        r = httpx.get(f"{self.url}/workers", headers=self.headers, timeout=5.0)
        if r.status_code != 200:
            raise BiEngineError(f"sglang-router GET /workers answered {r.status_code}: {r.text[:200]}")
        return r.json()["workers"]

    def add(self, url: str) -> None:
        body = {"url": url, **({"api_key": self.api_key} if self.api_key is not None else {})}
        r = httpx.post(f"{self.url}/workers", json=body, headers=self.headers, timeout=10.0)
        if r.status_code >= 300:
            raise BiEngineError(f"sglang-router refused worker {url}: {r.status_code} {r.text[:200]}")

    def remove(self, url: str) -> bool:
        """Take ``url`` out of rotation; False when the router does not have it."""
        for w in self.workers():
            if w["url"] == url:
                r = httpx.delete(f"{self.url}/workers/{w['id']}", headers=self.headers, timeout=10.0)
                if r.status_code >= 300:
                    raise BiEngineError(f"sglang-router did not remove worker {url}: {r.status_code} {r.text[:200]}")
                return True
        return False

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, num_lines: int = 8) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return " | ".join(lines[-num_lines:]) or "(no output)"

    def stop(self, timeout_s: float) -> None:
        if self.proc is not None:
            terminate(self.proc, timeout_s)
