"""``bi-engine serve --data-parallel-size 2`` on a Ray instance on this machine: two replicas in a
placement group behind sglang-router, the control routes fanned out to both (a weight sync from a
trainer into both at once), a replica killed under load reported and replaced while the other goes
on, and SIGTERM stopping every process."""

from __future__ import annotations

import os
import signal
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray")
pytest.importorskip("sglang_router")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from scale_helpers import MODEL, Deployment, finished, wait_until  # noqa: E402

PROMPT = {"model": MODEL, "prompt": "Batch invariance means", "max_tokens": 8, "temperature": 0}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("dp"), "--data-parallel-size", "2", "--router-policy", "round_robin")
    try:
        yield d.wait()
    finally:
        pids = [r["pid"] for r in d.replicas()] if d.proc.poll() is None else []
        code = d.stop()  # SIGTERM to the driver alone, as a process manager sends it
        log = d.log_path.read_text()
        assert code == 0 and "[replicas] stopped" in log, log
        assert not [p for p in pids if alive(p)], f"replica servers left running: {pids}"


def completion(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_replicas_in_a_placement_group_answer_alike(deployment):
    replicas = deployment.replicas()
    assert [r["state"] for r in replicas] == ["serving", "serving"]
    assert len({r["url"] for r in replicas}) == 2 and all(r["restarts"] == 0 for r in replicas)
    direct = [completion(r["url"], PROMPT)["choices"][0]["text"] for r in replicas]
    # the replicas listen beyond loopback: their control routes take only the key the front holds
    r = httpx.post(f"{replicas[0]['url']}/pause", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    before = [finished(r["url"]) for r in replicas]
    c = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0)
    routed = [c.completions.create(**PROMPT).choices[0].text for _ in range(4)]
    assert [finished(r["url"]) - b for r, b in zip(replicas, before)] == [2, 2]  # round robin
    assert direct[0] == direct[1] and routed == [direct[0]] * 4


def test_control_routes_reach_every_replica(deployment):
    c = deployment.control
    r = httpx.post(f"{c}/pause", params={"mode": "keep"}, timeout=30).json()
    assert r["success"] and r["status"] == "paused" and [a["body"] for a in r["replicas"]] == [{"status": "paused"}] * 2
    assert httpx.get(f"{c}/is_paused", timeout=30).json()["is_paused"] is True
    for replica in deployment.replicas():  # each one really is paused
        assert httpx.get(f"{replica['url']}/is_paused", timeout=10).json() == {"is_paused": True}
    assert httpx.post(f"{c}/resume", timeout=30).json()["status"] == "resumed"
    assert httpx.get(f"{c}/is_paused", timeout=30).json()["is_paused"] is False
    flushed = httpx.post(f"{c}/flush_cache", timeout=30).json()
    assert flushed["success"] and [a["status_code"] for a in flushed["replicas"]] == [200, 200]
    assert httpx.get(f"{c}/get_world_size", timeout=10).json() == {"world_size": 2}
    assert httpx.post(f"{c}/sleep", params={"level": 1}, timeout=60).json()["success"]
    assert httpx.get(f"{c}/is_sleeping", timeout=30).json()["is_sleeping"] is True
    refused = httpx.post(f"{c}/sleep", params={"level": 3}, timeout=30)  # each replica refuses: their status
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "level"
    assert httpx.post(f"{c}/wake_up", timeout=60).json()["success"]
    assert httpx.get(f"{c}/is_sleeping", timeout=30).json()["is_sleeping"] is False
    assert httpx.post(f"{c}/abort_requests", timeout=30).json()["success"]
    one = httpx.post(f"{c}/abort_requests", json={"request_ids": ["cmpl-1"]}, timeout=30)
    assert one.status_code == 400 and one.json()["error"]["param"] == "request_ids"
    assert completion(deployment.url, PROMPT)["usage"]["completion_tokens"] == 8  # awake and serving


def test_a_weight_group_that_does_not_count_every_replica_is_refused(deployment):
    r = httpx.post(f"{deployment.control}/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "world_size" and "1 + 2 x 1 = 3" in error["message"]


def test_a_replica_killed_under_load_is_reported_and_replaced(deployment):
    """SIGKILL one replica's server while 12 requests run: the router retries the plain requests it
    had on the other replica, a stream it had ends in an error (never a silent cut), the supervisor
    reports the death, takes it out of the router and starts it again."""
    c = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=120)
    results: dict[int, tuple] = {}
    body = {"model": MODEL, "max_tokens": 96, "temperature": 0, "extra_body": {"ignore_eos": True}}

    def plain(i: int) -> None:
        try:
            r = c.completions.create(prompt=f"plain {i}", **body)
            results[i] = ("ok", r.choices[0].finish_reason, r.usage.completion_tokens)
        except openai.APIError as e:
            results[i] = ("error", type(e).__name__)

    def stream(i: int) -> None:
        finish, tokens = None, None
        try:
            for chunk in c.completions.create(prompt=f"stream {i}", stream=True,
                                              stream_options={"include_usage": True}, **body):
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            results[i] = ("ok", finish, tokens)
        except openai.APIError as e:
            results[i] = ("error", type(e).__name__)

    victim = deployment.replicas()[0]
    threads = [threading.Thread(target=plain if i % 2 else stream, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    wait_until(lambda: httpx.get(f"{victim['url']}/get_load", timeout=5).json()[0]["num_reqs"] > 0, 30,
               "requests on the victim")
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert len(results) == 12, "a request never came back"
    assert all(results[i][:2] == ("ok", "length") and results[i][2] == 96 for i in range(1, 12, 2)), results
    assert all(results[i] in (("error", "APIConnectionError"), ("ok", "length", 96)) for i in range(0, 12, 2)), results

    def replaced() -> bool:
        r = deployment.replicas()[0]
        return r["state"] == "serving" and r["url"] != victim["url"]

    wait_until(replaced, 60, "replacement")
    now = deployment.replicas()
    assert now[0]["restarts"] == 1 and "exited with status -9" in now[0]["failures"][0]["reason"]
    assert now[0]["failures"][0]["url"] == victim["url"] and now[1]["restarts"] == 0
    workers = httpx.get(f"{deployment.url}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(r["url"] for r in now) and all(w["is_healthy"] for w in workers)
    assert f"replica 0 ({victim['url']}) failed: the server exited with status -9" in deployment.log_path.read_text()
    before = finished(now[0]["url"])
    for _ in range(4):
        completion(deployment.url, PROMPT)
    assert finished(now[0]["url"]) - before == 2  # back in rotation


def test_a_replica_whose_actor_dies_is_replaced_and_its_server_goes_with_it(deployment):
    """SIGKILL the Ray actor that holds replica 1 (as when its node is lost): its server gets SIGTERM
    (it must not outlive the actor), and the supervisor starts a new actor in the bundle."""
    victim = deployment.replicas()[1]
    actor_pid = int(open(f"/proc/{victim['pid']}/stat").read().rsplit(")", 1)[1].split()[1])  # the server's parent
    os.kill(actor_pid, signal.SIGKILL)
    wait_until(lambda: not alive(victim["pid"]), 30, "the server ending with its actor")

    def replaced() -> bool:
        r = deployment.replicas()[1]
        return r["state"] == "serving" and r["url"] != victim["url"]

    wait_until(replaced, 60, "replacement")
    assert "its actor died" in deployment.replicas()[1]["failures"][-1]["reason"]
    assert completion(deployment.replicas()[1]["url"], PROMPT)["choices"][0]["text"] == \
        completion(deployment.replicas()[0]["url"], PROMPT)["choices"][0]["text"]


def sync(deployment, seed: int, version: int) -> dict:
    """A trainer (rank 0) sends the seed-``seed`` model's weights to every live replica (ranks 1, 2)
    through the control front; the answer of its update call."""
    import torch
    import yaml
    from scale_helpers import CONFIG, free_port

    from bi_core import EngineConfig, build_engine
    from bi_core.rl import WeightSender

    c, port = deployment.control, free_port()
    cfg = yaml.safe_load(CONFIG)
    cfg["model"]["random"]["seed"] = seed
    weights = [(n, p.detach().clone()) for n, p in build_engine(EngineConfig.from_dict(cfg)).model.named_parameters()]
    joined: list = []
    join = threading.Thread(target=lambda: joined.append(httpx.post(f"{c}/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3}, timeout=120)))
    join.start()
    with WeightSender("127.0.0.1", port, world_size=3, timeout_s=60) as sender:
        join.join()
        assert joined[0].status_code == 200 and joined[0].json()["success"], joined[0].text

        def request_update(names, dtypes, shapes):
            r = httpx.post(f"{c}/update_weights_from_distributed", json={
                "names": names, "dtypes": dtypes, "shapes": shapes, "weight_version": version}, timeout=120)
            r.raise_for_status()
            return r.json()

        with torch.no_grad():
            done = sender.send(weights, request_update)
    assert httpx.post(f"{c}/destroy_weights_update_group", timeout=30).json()["success"]
    return done


def test_a_weight_sync_reaches_both_replicas_at_once(deployment):
    """One group, one broadcast per bucket: both replicas take the new weights, then answer alike."""
    before = completion(deployment.url, PROMPT)["choices"][0]["text"]
    done = sync(deployment, seed=1, version=5)
    assert done["success"] and done["weight_version"] == 5 and len(done["replicas"]) == 2
    assert httpx.get(f"{deployment.control}/get_weight_version", timeout=10).json()["weight_version"] == 5
    after = [completion(r["url"], PROMPT)["choices"][0]["text"] for r in deployment.replicas()]
    assert after[0] == after[1] != before
    assert httpx.get(f"{deployment.control}/replicas", timeout=10).json()["fleet_weight_version"] == 5


def test_a_replica_that_missed_a_weight_update_stays_out_until_one_reaches_it(deployment):
    """Killed after the update, replica 1 comes back with the checkpoint's weights: reported stale and
    kept out of the router (its answers would differ) until the next sync, which reaches it too."""
    victim = deployment.replicas()[1]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: deployment.replicas()[1]["state"] == "stale", 60, "stale replica")
    now = deployment.replicas()
    assert "weight version 0, the others have 5" in now[1]["failures"][-1]["reason"]
    workers = httpx.get(f"{deployment.url}/workers", timeout=10).json()["workers"]
    assert [w["url"] for w in workers] == [now[0]["url"]]
    done = sync(deployment, seed=2, version=6)  # the stale replica is up: it takes part
    assert done["success"] and [a["replica"] for a in done["replicas"]] == [0, 1]
    wait_until(lambda: deployment.replicas()[1]["state"] == "serving", 10, "readmission")
    workers = httpx.get(f"{deployment.url}/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers) == sorted(r["url"] for r in deployment.replicas())
    texts = [completion(r["url"], PROMPT)["choices"][0]["text"] for r in deployment.replicas()]
    assert texts[0] == texts[1]
