"""The scale extra stays optional: a lone server never imports Ray or sglang-router, replicas
without them are one error naming the extra, and the replica flags are checked before anything
starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from scale_helpers import ENV, MODEL, Server, write_config  # noqa: E402

BLOCKED = ("ray", "sglang_router")


def blocked_env(tmp: Path) -> dict:
    """PYTHONPATH with stand-ins for Ray and sglang-router that fail on import, as when they are not
    installed (and show any import of them, even one in a try)."""
    for name in BLOCKED:
        (tmp / "blocked" / name).mkdir(parents=True, exist_ok=True)
        (tmp / "blocked" / name / "__init__.py").write_text(f'raise ImportError("No module named {name!r}")\n')
    import os

    return {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(tmp / "blocked"), os.environ.get("PYTHONPATH", "")])}


def serve(tmp: Path, *args: str, env: dict | None = None, config: str | None = None) -> subprocess.CompletedProcess:
    path = write_config(tmp) if config is None else write_config(tmp, config)
    return subprocess.run([sys.executable, "-m", "bi_core.cli", "serve", "--config", str(path), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_the_blockers_block(tmp_path):
    """Negative control: under the stand-ins, importing Ray fails (so the tests below can fail)."""
    r = subprocess.run([sys.executable, "-c", "import ray"], capture_output=True, text=True, env=blocked_env(tmp_path))
    assert r.returncode != 0 and "ImportError: No module named 'ray'" in r.stderr, r.stderr


def test_a_lone_server_serves_without_ray_or_the_router(tmp_path):
    env = blocked_env(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import sys, bi_core.cli, bi_core.serve.app, bi_core.scale; "
                        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'sglang_router')))"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
    server = Server(tmp_path / "server", env={"PYTHONPATH": env["PYTHONPATH"]}).wait()
    try:
        out = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4,
                                                                "temperature": 0}, timeout=60)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 4
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("how", ["flag", "yaml"])
def test_replicas_without_the_scale_extra_is_one_error_naming_it(tmp_path, how):
    from scale_helpers import CONFIG

    if how == "flag":
        r = serve(tmp_path, "--data-parallel-size", "2", "--port", "0", env=blocked_env(tmp_path))
    else:
        r = serve(tmp_path, "--port", "0", env=blocked_env(tmp_path),
                  config=CONFIG + "parallel: {data_parallel_size: 2}\n")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "data_parallel_size" in lines[0] and "ray and sglang-router" in lines[0]
    assert "pip install 'bi-engine[scale]'" in lines[0]


@pytest.mark.parametrize("args, expected", [
    (["--router-policy", "round_robin"], "--router-policy: only with replicas"),
    (["--ray-address", "auto", "--control-port", "9000"], "--ray-address, --control-port: only with replicas"),
    (["--data-parallel-size", "2", "--router-policy", "fastest"],
     "--router-policy: expected one of cache_aware, round_robin, power_of_two, random; got 'fastest'"),
    (["--data-parallel-size", "0"], "--data-parallel-size: expected a positive int, got 0"),
    (["--data-parallel-size", "2", "--dev-mode"], "--dev-mode: with one server only"),
    (["--data-parallel-size", "2", "--router-args", "--policy random"], "--router-args: --policy are set by"),
    (["--data-parallel-size", "2", "--router-args", "--cache-threshold 'x"], "--router-args: No closing quotation"),
])
def test_bad_replica_flags_are_one_error_naming_the_flag(tmp_path, args, expected):
    r = serve(tmp_path, *args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("bi-engine: error: ") and expected in lines[0], lines[0]


def test_the_yaml_key_is_checked(tmp_path):
    from scale_helpers import CONFIG

    r = serve(tmp_path, config=CONFIG + "parallel: {data_parallel_size: 0}\n")
    assert r.returncode == 2 and "parallel.data_parallel_size: expected a positive int, got 0" in r.stderr


def test_the_scale_extra_and_the_test_extra_bring_ray_and_the_router():
    """Installing the test extra runs tests/scale in CI (else its tests would skip); the scale extra
    brings what replicas need, the serve extra with it."""
    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for extra in ("scale", "test"):
        names = {req.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip() for req in extras[extra]}
        assert {"ray", "sglang-router"} <= names, (extra, extras[extra])
    assert "bi-engine[serve]" in extras["scale"]
