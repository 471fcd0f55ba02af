"""The pieces on their own: merging replicas' answers into one, and the bundles a placement asks
Ray for."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from bi_core.config import EngineConfig  # noqa: E402
from bi_core.errors import BiEngineError  # noqa: E402
from bi_core.scale.fanout import Answer, merge  # noqa: E402


def test_answers_that_agree_keep_their_shared_fields_at_the_top():
    status, body = merge("/pause", [Answer(0, "u0", 200, {"status": "paused", "n": 1}),
                                    Answer(1, "u1", 200, {"status": "paused", "n": 2})], [])
    assert status == 200 and body["success"] is True and body["status"] == "paused" and "n" not in body
    assert body["message"] == "/pause: done on all 2 replicas" and [r["replica"] for r in body["replicas"]] == [0, 1]


def test_one_failed_replica_fails_the_call_and_is_named():
    status, body = merge("/sleep", [Answer(0, "u0", 200, None), Answer(1, "u1", None, error="ConnectError: refused")],
                         [{"replica": 2, "state": "restarting"}])
    assert status == 502 and body["success"] is False
    assert body["message"] == "/sleep: 1 of 2 replicas succeeded; failed: 1 (ConnectError: refused)"
    assert body["replicas"][1]["error"] == "ConnectError: refused" and body["skipped"] == [
        {"replica": 2, "state": "restarting"}]


def test_replicas_that_all_refuse_give_their_own_status():
    err = {"error": {"message": "bad level", "param": "level"}}
    status, body = merge("/sleep", [Answer(0, "u0", 400, err), Answer(1, "u1", 400, err)], [])
    assert status == 400 and body["success"] is False and body["error"] == err["error"]


def test_no_replica_up_is_a_failure():
    status, body = merge("/resume", [], [{"replica": 0, "state": "failed"}])
    assert status == 502 and body["success"] is False and "no replica is up" in body["message"]
    assert body["error"] == {"message": body["message"], "type": "server_error", "param": None,
                             "code": "replicas_failed"}  # OpenAI's shape, as a lone server's refusals


def config(device: str = "cpu", tp: int = 1) -> EngineConfig:
    return EngineConfig.from_dict({"model": {"random": {"preset": "tiny-dense"}, "device": device},
                                   "parallel": {"tensor_parallel_size": tp}})


def test_bundles_hold_a_replicas_gpus_or_one_cpu():
    pytest.importorskip("ray")
    from bi_core.scale.placement import bundles

    assert bundles(config("cpu"), 2, {"CPU": 2.0, "GPU": 8.0}) == [{"CPU": 1}, {"CPU": 1}]
    assert bundles(config("cuda", tp=2), 3, {"CPU": 64.0, "GPU": 8.0}) == [{"CPU": 1, "GPU": 2}] * 3
    assert bundles(config("auto", tp=2), 2, {"CPU": 4.0}) == [{"CPU": 1}] * 2  # no GPU in the cluster: CPU
    assert bundles(config("auto", tp=2), 2, {"CPU": 4.0, "GPU": 4.0}) == [{"CPU": 1, "GPU": 2}] * 2


def test_a_cluster_too_small_or_a_pinned_gpu_is_one_error():
    pytest.importorskip("ray")
    from bi_core.scale.placement import bundles

    with pytest.raises(BiEngineError, match=r"5 replicas need 10 GPU \(2 each = tensor_parallel_size\); the Ray "
                                            r"cluster has 8"):
        bundles(config("cuda", tp=2), 5, {"CPU": 64.0, "GPU": 8.0})
    with pytest.raises(BiEngineError, match=r"3 replicas need 3 CPU \(1 each\); the Ray cluster has 2"):
        bundles(config("cpu"), 3, {"CPU": 2.0})
    with pytest.raises(BiEngineError, match="model.device: cuda:1 names one GPU"):
        bundles(config("cuda:1"), 2, {"CPU": 4.0, "GPU": 4.0})


def test_free_port_never_gives_a_port_twice(monkeypatch):
    """The OS may hand the same ephemeral port to two binds in a row (a CI run got the router's port
    for the control app, and the deployment refused to start): ``free_port`` skips any port it gave
    before in this process."""
    import socket

    from bi_core import ports

    given = iter([50001, 50001, 50001, 50002])

    class FakeSocket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(given)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(ports, "_given", set())
    monkeypatch.setattr(socket, "socket", FakeSocket)
    assert ports.free_port("127.0.0.1") == 50001
    assert ports.free_port("127.0.0.1") == 50002  # 50001 twice more from the OS, skipped
