"""The control front on its own (a stand-in supervisor, the replicas answered by a mock transport):
who may call it (the lone server's rule, ``bi_core.serve.auth``), what the replicas receive (the
front's key for them, never the client's header), the key a deployment makes for its replicas,
and refusals as OpenAI-shaped JSON."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from bi_core.config import ServeConfig  # noqa: E402
from bi_core.scale.deployment import replica_control_key  # noqa: E402
from bi_core.scale.front import ControlFront, create_front  # noqa: E402
from bi_core.serve.auth import Guard  # noqa: E402


class Supervisor:
    """Two replicas up."""

    replicas = [0, 1]
    fleet_weight_version = 0
    router = types.SimpleNamespace(returncode=lambda: None)

    def live(self):
        return [types.SimpleNamespace(index=i, url=f"http://r{i}") for i in self.replicas]

    def statuses(self):
        return [{"replica": i, "state": "serving"} for i in self.replicas]

    def weights_updated(self, versions):
        pass


def front(guard: Guard, replica_key: str | None = "rk"):
    seen: list[httpx.Request] = []

    def replica(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"status": "paused"})

    f = ControlFront(Supervisor(), 1, guard, replica_key, "http://router")
    f.client = httpx.AsyncClient(transport=httpx.MockTransport(replica))
    return TestClient(create_front(f)), seen


def test_the_front_beyond_loopback_without_a_key_refuses_control_with_openais_shape():
    client, seen = front(Guard("0.0.0.0"))
    r = client.post("/pause")
    assert r.status_code == 403 and r.json()["error"]["code"] == "control_routes_disabled", r.text
    assert seen == [] and client.get("/health").status_code == 200 and client.get("/replicas").status_code == 200
    r = client.post("/v1/completions", json={})  # not a route here: still OpenAI's shape
    assert r.status_code == 404 and "router's port" in r.json()["error"]["message"], r.text
    r = client.post("/replicas")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_the_replicas_get_the_fronts_key_never_the_clients_header():
    client, seen = front(Guard("127.0.0.1", api_key="k"))
    assert client.post("/pause", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = client.post("/pause", headers={"Authorization": "bearer k"})
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    assert [q.headers["authorization"] for q in seen] == ["Bearer rk", "Bearer rk"]
    r = client.post("/abort_request", json={"rid": "x"}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    r = client.post("/abort_request", json={"rid": "", "abort_all": False}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 200 and len(seen) == 2  # verl's default call: nothing to abort, nothing fanned out


def test_a_deployment_without_keys_gives_its_replicas_one_of_their_own():
    data: dict = {"serve": {"model_name": "tiny"}}
    key = replica_control_key(ServeConfig(), data)
    assert key and len(key) >= 32 and data["serve"] == {"model_name": "tiny", "admin_api_key": key}
    assert replica_control_key(ServeConfig(), {}) != key  # one per deployment
    kept: dict = {}
    assert replica_control_key(ServeConfig(api_key="k"), kept) == "k" and kept == {}
    assert replica_control_key(ServeConfig(api_key="k", admin_api_key="a"), kept) == "a" and kept == {}
