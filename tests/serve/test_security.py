"""Control routes that cannot be turned against the server (issue 58): a tensor payload that runs
code is refused over HTTP and runs nothing; the keys (SGLang's api_key and admin_api_key, the
Bearer scheme in any case) guard the routes they should; a server that listens beyond loopback
without a key answers its control routes 403 unless told otherwise; a disk update reads only under
its root."""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import threading
import types

import pytest
from serve_helpers import CONFIG, ServerProcess, httpx

from bi_core.serve.auth import CONTROL_PATHS, Guard, bearer_token, is_loopback

LONG = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}


# ------------------------------------------------------------------ the rule, on its own


def test_loopback_is_127_8_ipv6_one_and_localhost_only():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "", "10.0.0.5", "192.168.1.2", "myhost", "::ffff:1.2.3.4"))


def test_the_bearer_scheme_is_case_insensitive():
    assert bearer_token("Bearer k") == bearer_token("bearer k") == bearer_token("BEARER  k ") == "k"
    assert bearer_token("Basic k") is None and bearer_token("Bearer") is None and bearer_token(None) is None


def test_which_key_opens_which_route():
    open_, control, other = "/health_generate", "/update_weights_from_tensor", "/v1/completions"

    def status(guard: Guard, path: str, header: str | None = None) -> int:
        e = guard.check(path, header)
        return 200 if e is None else e.status

    local, wide = Guard("127.0.0.1"), Guard("0.0.0.0")
    assert [status(local, p) for p in (open_, control, other)] == [200, 200, 200]
    assert [status(wide, p) for p in (open_, control, other)] == [200, 403, 200]
    assert status(Guard("0.0.0.0", allow_unauthenticated_control=True), control) == 200
    keyed = Guard("0.0.0.0", api_key="k")
    assert [status(keyed, control), status(keyed, control, "bearer k"), status(keyed, other, "Bearer x")] == \
        [401, 200, 401]
    both = Guard("0.0.0.0", api_key="k", admin_api_key="a")  # SGLang's: control needs the admin key, not api_key
    assert [status(both, control, "Bearer k"), status(both, control, "Bearer a"), status(both, other, "Bearer a"),
            status(both, other, "Bearer k"), status(both, open_)] == [401, 200, 401, 200, 200]
    admin_only = Guard("10.1.2.3", admin_api_key="a")  # generation stays open, control needs the key
    assert [status(admin_only, other), status(admin_only, control), status(admin_only, control, "Bearer a")] == \
        [200, 401, 200]
    assert [status(g, p) for g in (keyed, both) for p in ("/ping", "/metrics", "/health")] == [200] * 6
    e = wide.check(control, None)
    assert e.body["error"]["code"] == "control_routes_disabled" and "serve.allow_unauthenticated_control" in \
        e.body["error"]["message"] and "0.0.0.0" in e.body["error"]["message"]
    assert keyed.check(control, None).headers == {"WWW-Authenticate": "Bearer"}


def _routes(install) -> dict[str, set[str]]:
    from fastapi import FastAPI

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    install(app, types.SimpleNamespace(call=None, requests={}, tensor_parallel_size=1))
    return {r.path: set(r.methods) for r in app.routes if hasattr(r, "methods")}


def test_every_route_that_changes_the_engine_is_a_control_route():
    """A new control route that is not in CONTROL_PATHS would answer without the admin key."""
    from bi_core.serve import control_routes, dev, lora_routes

    routes = {**_routes(control_routes.install), **_routes(dev.install), **_routes(lora_routes.install)}
    changing = {p for p, methods in routes.items() if methods - {"GET", "HEAD"} or p in ("/flush_cache",)}
    assert changing == CONTROL_PATHS, changing ^ CONTROL_PATHS
    assert {p for p in routes if p not in CONTROL_PATHS} == {
        "/is_paused", "/is_sleeping", "/get_world_size", "/weight_info", "/get_weight_version", "/get_model_info",
        "/model_info"}  # reads only


def test_the_start_says_when_control_is_off_or_open_to_anyone(caplog):
    from bi_core.serve import note_control_guard

    log = logging.getLogger("test.guard")
    with caplog.at_level(logging.WARNING, logger="test.guard"):
        note_control_guard(Guard("127.0.0.1"), "the server", log)
        note_control_guard(Guard("0.0.0.0", api_key="k"), "the server", log)
        assert caplog.records == []
        note_control_guard(Guard("0.0.0.0", allow_unauthenticated_control=True), "the server", log)
        note_control_guard(Guard("0.0.0.0"), "the server", log)
    assert "answer anyone who reaches 0.0.0.0 without a key" in caplog.records[0].getMessage()
    assert "answer 403 until serve.admin_api_key or serve.api_key is set" in caplog.records[1].getMessage()


# ------------------------------------------------------------------ a server beyond loopback


def test_beyond_loopback_without_a_key_the_control_routes_answer_403_and_generation_goes_on(tmp_path):
    made = tmp_path / "made"
    evil = base64.b64encode(pickle.dumps([("w", Evil(f"touch {made}"))])).decode()
    s = ServerProcess(tmp_path, "--host", "0.0.0.0")
    try:
        for path, body in (("/pause", None), ("/update_weights_from_tensor", {"serialized_named_tensors": [evil]}),
                           ("/update_weights_from_disk", {"model_path": "/"}), ("/abort_request", {"abort_all": True})):
            r = httpx.post(f"{s.url}{path}", json=body, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 403 and err["type"] == "permission_error", r.text
            assert err["code"] == "control_routes_disabled" and "serve.admin_api_key" in err["message"]
        assert not made.exists()
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(f"{s.url}/get_weight_version").json() == {"weight_version": 0}  # reads stay open
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        assert s.stop() == 0
    assert "its control routes answer 403 until serve.admin_api_key or serve.api_key is set" in s.log_path.read_text()


def test_the_admin_key_opens_the_control_routes_and_the_api_key_the_rest(tmp_path):
    config = CONFIG.replace("shutdown_timeout_s: 20}", "shutdown_timeout_s: 20, api_key: k}")
    s = ServerProcess(tmp_path, "--host", "0.0.0.0", "--admin-api-key", "a", config=config)  # the flag sets the key
    try:
        url, body = f"{s.url}/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
        assert httpx.post(url, json=body, headers={"Authorization": "bearer k"}, timeout=60).status_code == 200
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer a"}, timeout=60)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        r = httpx.post(f"{s.url}/pause", headers={"Authorization": "Bearer k"}, timeout=60)
        assert r.status_code == 401 and "admin API key" in r.json()["error"]["message"], r.text
        for path in ("/pause", "/resume"):
            r = httpx.post(f"{s.url}{path}", headers={"Authorization": "BEARER a"}, timeout=60)
            assert r.status_code == 200, r.text
    finally:
        assert s.stop() == 0


class Evil:
    """A pickled ``os.system(command)``: what a malicious tensor payload carries."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Loopback, no key: the control routes answer (a trainer on this machine)."""
    s = ServerProcess(tmp_path_factory.mktemp("local"))
    yield s
    s.stop()


def test_a_tensor_payload_that_runs_code_is_refused_and_runs_nothing(local, tmp_path):
    made = tmp_path / "made"
    for obj in (Evil(f"touch {made}"), [("model.norm.weight", Evil(f"touch {made}"))]):
        payload = base64.b64encode(pickle.dumps(obj)).decode()
        r = httpx.post(f"{local.url}/update_weights_from_tensor", json={"serialized_named_tensors": [payload]},
                       timeout=60)
        got = r.json()
        assert r.status_code == 400 and got["success"] is False, r.text
        assert "names the global posix.system, which is not one of torch's tensor-sharing" in got["message"]
    assert not made.exists()
    assert httpx.get(f"{local.url}/get_weight_version").json() == {"weight_version": 0}



def test_a_disk_update_reads_only_under_its_root(local):
    r = httpx.post(f"{local.url}/update_weights_from_disk", json={"model_path": ""}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_path", r.text  # "" is the working dir
    r = httpx.post(f"{local.url}/update_weights_from_disk", json={"model_path": "/etc"}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 403 and err["code"] == "outside_weights_root" and "serve.weights_root" in err["message"]


# ------------------------------------------------------------------ verl's calls


def test_verls_default_calls_work(local):
    """verl's SGLang adapter: abort_request(rid="", abort_all=False) by default (nothing to abort, as
    SGLang answers it), SGLang's abort message and finished_reason fields, and
    release_memory_occupation with reset_connector (no KV connector here: nothing to drop)."""
    for body in ({"rid": "", "abort_all": False}, {}, {"rid": None, "abort_all": False, "abort_message": None,
                                                       "finished_reason": None}):
        r = httpx.post(f"{local.url}/abort_request", json=body, timeout=60)
        assert r.status_code == 200, (body, r.text)
    r = httpx.post(f"{local.url}/abort_request", json={"rid": "x", "finished_reason": {"type": "abort"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "finished_reason", r.text
    for flag in (True, False):
        r = httpx.post(f"{local.url}/release_memory_occupation", json={"tags": None, "reset_connector": flag},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.post(f"{local.url}/resume_memory_occupation", json={"tags": None}, timeout=60).status_code == 200
    got, first = [], threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{local.url}/generate", json={"input_ids": [1, 2], "sampling_params": LONG,
                                                                "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(line.removeprefix("data: "))
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(60)
    r = httpx.post(f"{local.url}/abort_request", json={"abort_all": True, "abort_message": "rollout cut short"})
    assert r.status_code == 200, r.text
    t.join(60)
    assert json.loads(got[-2])["meta_info"]["finish_reason"] == {"type": "abort", "message": "rollout cut short"}
