"""Real processes for tests/scale: lone ``bi-engine serve`` servers (the tiny dense model on the
reference backend, CPU), the released sglang-router in front of them, and whole
``bi-engine serve --data-parallel-size N`` deployments. Every process gets one torch thread, so
that a request alone in its batch gets the same bits from every process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bi_core.ports import free_port as _free_port
from bi_core.scale.processes import terminate

# prefill_chunk_size 16: the prefix cache keeps (and hits) prompts at multiples of 16 tokens
CONFIG = """
model: {random: {preset: tiny-dense, seed: 0}, dtype: float32, device: cpu, max_model_len: 512}
backend: reference
scheduler: {max_num_seqs: 32, max_num_batched_tokens: 1024, prefill_chunk_size: 16}
cache: {block_size: 16, num_blocks: 512, prefix_snapshots: 64}  # 3 prompt groups x 4 grid points
serve: {model_name: tiny, shutdown_timeout_s: 5}
"""
MODEL = "tiny"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    return _free_port("127.0.0.1")


def wait_until(check, within_s: float, what: str, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s} s")
        time.sleep(every_s)


def answers(url: str, path: str) -> bool:
    try:
        return httpx.get(f"{url}{path}", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def metric(url: str, name: str) -> float:
    """One sample of a server's /metrics (name with its labels, as printed); missing fails the test."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match is not None, f"{url}/metrics has no {name}"
    return float(match.group(1))


def finished(url: str) -> float:
    return metric(url, 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}')


def write_config(tmp: Path, text: str = CONFIG) -> Path:
    path = tmp / "serve.yaml"
    path.write_text(text)
    return path


class Server:
    """One lone ``bi-engine serve`` process."""

    def __init__(self, tmp: Path, *extra: str, env: dict | None = None) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "bi_core.cli", "serve", "--config",
                                          str(write_config(tmp)), "--port", str(self.port), *extra],
                                         stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV, **(env or {})})

    def wait(self) -> Server:
        wait_until(lambda: self.proc.poll() is not None or answers(self.url, "/health"), 120, "server start")
        assert self.proc.poll() is None, self.log_path.read_text()
        return self

    def stop(self) -> int:
        return terminate(self.proc, 60)


class Deployment:
    """``bi-engine serve --data-parallel-size N``: the router on ``url``, the control front on
    ``control``."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        port, self.control_port = free_port(), free_port()
        self.url, self.control = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{self.control_port}"
        self.log_path = tmp / "deployment.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "bi_core.cli", "serve", "--config",
                                          str(write_config(tmp)), "--port", str(port), "--control-port",
                                          str(self.control_port), *extra], stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **ENV})

    def wait(self) -> Deployment:
        def up() -> bool:
            try:
                return httpx.get(f"{self.control}/health", timeout=2).json().get("status") == "ok"
            except (httpx.HTTPError, ValueError):
                return False

        wait_until(lambda: self.proc.poll() is not None or up(), 180, "deployment start")
        assert self.proc.poll() is None, self.log_path.read_text()
        return self

    def replicas(self) -> list[dict]:
        return httpx.get(f"{self.control}/replicas", timeout=10).json()["replicas"]

    def stop(self) -> int:
        return terminate(self.proc, 120)
