"""vLLM's dev-mode ``POST /collective_rpc`` through a real server: absent (404) without dev mode,
present with ``--dev-mode`` (built-ins and an extension class from this module, vLLM's answer
shape: None, objects and lists as they are, anything else as a string), each refusal in the
server's error format (400 for a bad body or method, 500 for a method that raised or timed out), the
engine still serving after. The engine loop's shaping of results, and ``VLLM_SERVER_DEV_MODE``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from serve_helpers import API_KEY, CONFIG, ScriptedChannel, ServerProcess, httpx

from bi_core.config import ServeConfig
from bi_core.errors import CollectiveRpcError
from bi_core.serve.dev import dev_mode
from bi_core.serve.loop import EngineLoop
from bi_core.serve.loop_control import _Failed, _rpc_result
from bi_core.serve.messages import CollectiveRpc

HERE = Path(__file__).parent
DEV_CONFIG = CONFIG + f"parallel: {{worker_extension_cls: '{__name__}:Remote'}}\n"


class Remote:
    """The extension the dev server's engine mixes into its worker (strings in, as vLLM sends)."""

    def echo(self, *args: str, **kwargs: str) -> dict:
        return {"rank": self.rank, "args": list(args), "kwargs": kwargs}

    def pair(self) -> tuple:
        return (self.rank, self.world_size)

    def fail(self) -> None:
        raise ValueError("no such thing")

    def nap(self, seconds: str) -> None:
        import time

        time.sleep(float(seconds))


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    path = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH")) if p)  # imports Remote
    s = ServerProcess(tmp_path_factory.mktemp("dev"), "--dev-mode", config=DEV_CONFIG, env={"PYTHONPATH": path})
    yield s
    s.stop()


def rpc(server, body: dict | None, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/collective_rpc", json=body, timeout=120, **kw)


def test_without_dev_mode_the_route_does_not_exist(server):
    r = rpc(server, {"method": "weight_version"}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found", r.text


@pytest.mark.parametrize("body,results", [
    ({"method": "weight_version"}, ["0"]),  # not an object or a list: its str(), as vLLM answers
    ({"method": "report_device_id"}, ["cpu"]),
    ({"method": "echo", "args": ["a", "b"], "kwargs": {"k": "v"}, "timeout": 30},
     [{"rank": 0, "args": ["a", "b"], "kwargs": {"k": "v"}}]),
    ({"method": "pair"}, ["(0, 1)"]),
    ({"method": "nap", "args": ["0"], "kwargs": {}, "timeout": None}, [None]),
])
def test_dev_mode_calls_the_method_on_every_rank(dev, body, results):
    r = rpc(dev, body)
    assert r.status_code == 200 and r.json() == {"results": results}, r.text


@pytest.mark.parametrize("body,status,param,message", [
    ({}, 400, "method", "^Missing 'method' in request body$"),
    ({"args": ["x"]}, 400, "method", "^Missing 'method' in request body$"),
    ({"method": "nope"}, 400, None, "^collective_rpc: the worker has no method 'nope'; its methods: echo, fail, "),
    ({"method": "_secret"}, 400, None, "^collective_rpc: '_secret' is private"),
    ({"method": "echo", "args": [1]}, 400, "args[0]", "^args\\[0\\]: Input should be a valid string"),
    ({"method": "echo", "kwargs": {"k": 2}}, 400, "kwargs.k", "^kwargs.k: "),
    ({"method": "echo", "timeout": 0}, 400, "timeout", "^timeout: Input should be greater than 0"),
    ({"method": "echo", "when": 1}, 400, "when", "^when: Extra inputs are not permitted"),
    ({"method": "fail"}, 500, None, r"^collective_rpc: 'fail' failed on 1 of 1 tensor-parallel rank\(s\): rank 0: "
                                    r"ValueError: no such thing$"),
    ({"method": "nap", "args": ["0.4"], "timeout": 0.1}, 500, None, r"^collective_rpc: 'nap' timed out: "),
])
def test_refusals_answer_the_servers_error_format(dev, body, status, param, message):
    import re

    r = rpc(dev, body)
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == param and re.search(message, err["message"]), r.text
    assert err["type"] == ("invalid_request_error" if status == 400 else "server_error")
    ok = httpx.post(f"{dev.url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                    timeout=60)
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2  # the engine went on


@pytest.mark.parametrize("value,wire", [
    (None, None), ({"a": (1, 2)}, {"a": [1, 2]}), ([1.5, "x"], [1.5, "x"]), ({1: "a"}, {"1": "a"}), (3, "3"),
    (0.25, "0.25"), ((0, 1), "(0, 1)"), ({"nan": float("nan")}, "{'nan': nan}"), ([object], f"[{object!r}]"),
])
def test_each_result_is_sent_as_vllm_answers_it(value, wire):
    assert _rpc_result(value) == wire


class _Engine:
    def __init__(self, outcome) -> None:
        self.outcome, self.calls = outcome, []

    def collective_rpc(self, method, args, kwargs, timeout=None):
        self.calls.append((method, args, kwargs, timeout))
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    def is_paused(self) -> bool:
        return False

    def is_sleeping(self) -> bool:
        return False


def test_the_loop_passes_the_call_on_and_a_method_failure_is_the_callers_error():
    engine = _Engine([{"r": 0}, 2.5])
    loop = EngineLoop(engine, ScriptedChannel(), max_waiting=4)
    assert loop._collective_rpc(CollectiveRpc(1, "m", ["a"], {"k": "v"}, 2.0)) == [{"r": 0}, "2.5"]
    assert engine.calls == [("m", ("a",), {"k": "v"}, 2.0)]
    loop = EngineLoop(_Engine(CollectiveRpcError("collective_rpc: 'm' failed")), ScriptedChannel(), max_waiting=4)
    with pytest.raises(_Failed, match="^collective_rpc: 'm' failed$") as e:
        loop._collective_rpc(CollectiveRpc(2, "m", [], {}, None))
    assert e.value.reason == "error"


@pytest.mark.parametrize("flag,env,on", [(False, None, False), (True, None, True), (False, "1", True),
                                         (False, "0", False), (True, "0", True)])
def test_dev_mode_is_the_config_or_vllms_environment_variable(monkeypatch, flag, env, on):
    if env is None:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    else:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", env)
    assert dev_mode(ServeConfig(dev_mode=flag)) is on
