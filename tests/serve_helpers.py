"""A real ``bi-engine serve`` process on a free port, with the embedded tiny model on the CPU, and
what the server tests share (tests/serve, tests/clients). A module of its own name: two modules
named ``conftest`` would shadow each other on sys.path."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bi_core.ports import free_port as _free_port

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

API_KEY = "test-key"
CONFIG = """
model: {random: {preset: tiny-dense, seed: 0}, dtype: float32, device: cpu, max_model_len: 512}
backend: reference
scheduler: {max_num_seqs: 64, max_num_batched_tokens: 2048}
cache: {block_size: 16, num_blocks: 1024}
serve: {model_name: tiny, shutdown_timeout_s: 20}
"""


def metric(server, name: str) -> float:
    """A metric's value from /metrics; one the server does not export fails the test (a renamed
    gauge must not read as 0)."""
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match is not None, f"/metrics has no {name}"
    return float(match.group(1))


def aborted(server) -> float:
    return metric(server, 'bi_requests_finished_total{reason="abort"}')


def eventually(check, within_s: float, every_s: float = 0.1) -> bool:
    """Whether ``check()`` holds within ``within_s`` seconds (polled)."""
    deadline = time.monotonic() + within_s
    while True:
        if check():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)


def free_port() -> int:
    return _free_port("127.0.0.1")  # never the same port twice in this process


def families(server) -> dict:
    """/metrics parsed: {sample name: [(labels, value), ...]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def labeled(server_or_scrape, name: str, **labels) -> float:
    """One sample's value, by name and labels, from /metrics (or from one ``families`` scrape);
    a sample the server does not export fails the test."""
    scrape = server_or_scrape if isinstance(server_or_scrape, dict) else families(server_or_scrape)
    samples = scrape.get(name, [])
    found = [v for lab, v in samples if all(lab.get(k) == v2 for k, v2 in labels.items())]
    assert len(found) == 1, f"/metrics has {len(found)} samples {name} {labels}: {samples}"
    return found[0]


class ScriptedChannel:
    """A pipe end that delivers ``incoming`` and records what is sent (the engine loop's tests)."""

    def __init__(self, *incoming) -> None:
        self.incoming, self.sent = list(incoming), []

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.incoming)

    def recv(self):
        return self.incoming.pop(0)

    def send(self, msg) -> None:
        self.sent.append(msg)


class ServerProcess:
    def __init__(self, tmp: Path, *extra: str, config: str = CONFIG, env: dict | None = None) -> None:
        cfg = tmp / "serve.yaml"
        cfg.write_text(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = tmp / "server.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "bi_core.cli", "serve", "--config", str(cfg), "--port",
                                      str(self.port), *extra], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not come up")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return self.proc.returncode
