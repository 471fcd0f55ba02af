"""A server's edges: a port already taken, overload, and SIGTERM past serve.shutdown_timeout_s."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading

from serve_helpers import CONFIG, ServerProcess, eventually, httpx, metric

LONG = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def test_a_port_in_use_is_one_error_line_before_the_engine_is_built(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(CONFIG)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "bi_core.cli", "serve", "--config", str(cfg), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("bi-engine: error:") and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0]


def test_overload_is_503_with_retry_after(tmp_path):
    """One running request, one waiting (serve.max_waiting_requests 1): the next one is refused
    with a Retry-After, as a busy server should."""
    s = ServerProcess(tmp_path, config=CONFIG.replace("max_num_seqs: 64", "max_num_seqs: 1").replace(
        "shutdown_timeout_s: 20", "shutdown_timeout_s: 20, max_waiting_requests: 1"))
    try:
        url = f"{s.url}/v1/completions"
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as running:
            with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as waiting:
                assert running.status_code == waiting.status_code == 200
                r = httpx.post(url, json=LONG, timeout=60)
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", (r.status_code, r.headers)
        assert r.json()["error"]["type"] == "service_unavailable" and "waiting" in r.json()["error"]["message"]
    finally:
        assert s.stop() == 0


def test_sigterm_past_the_shutdown_timeout_answers_every_request(tmp_path):
    """Requests still running when serve.shutdown_timeout_s runs out (0 s here: at once) end with
    an OpenAI-shaped error (streams: an error event, then [DONE]); the log says so in one line, no
    traceback."""
    s = ServerProcess(tmp_path, config=CONFIG.replace("shutdown_timeout_s: 20", "shutdown_timeout_s: 0"))
    url, answers = f"{s.url}/v1/completions", {}

    def plain(i: int) -> None:
        answers[i] = httpx.post(url, json=LONG, timeout=60)

    def stream(i: int) -> None:
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
            answers[i] = [line for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=plain if i % 2 else stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert eventually(lambda: metric(s, "bi_requests_running") == 4, 30)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert s.stop() == 0
    for i in (1, 3):
        r = answers[i]
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
        assert "shutdown_timeout_s" in r.json()["error"]["message"]
    for i in (0, 2):
        assert answers[i][-1] == "data: [DONE]", answers[i][-3:]
        error = json.loads(answers[i][-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable" and "shutdown_timeout_s" in error["message"]
    log = s.log_path.read_text()
    assert "Traceback" not in log and "Exception" not in log, log
    assert sum("shutdown_timeout_s" in line for line in log.splitlines()) == 1, log
