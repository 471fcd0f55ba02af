"""A server between the states an RL loop puts it in (issue 58): after a level-2 sleep and a wake
without a weight sync every generation route answers one clear 409 (no token 0 with NaN
logprobs), /health says why, and a sync makes it serve again; a weight-update group whose trainer
never joins keeps the engine generating, shows in /health, is answered when its timeout ends, and
does not hold up a SIGTERM."""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time

from serve_helpers import CONFIG, ServerProcess, free_port, httpx

SAMPLING = {"max_new_tokens": 6, "temperature": 0.9, "sampling_seed": 3, "ignore_eos": True}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def sharer_main(conn) -> None:
    """A colocated trainer holding the seed-0 model's weights (the server's own), shared by handle."""
    import yaml

    from bi_core import EngineConfig, build_engine
    from bi_core.rl import serialize_named_tensors

    weights = [(n, p.detach().clone()) for n, p in
               build_engine(EngineConfig.from_dict(yaml.safe_load(CONFIG))).model.named_parameters()]
    conn.send(serialize_named_tensors(weights))
    conn.recv()


def _generate(s, **extra) -> httpx.Response:
    return httpx.post(f"{s.url}/generate", json={"input_ids": [5, 6, 7], "sampling_params": SAMPLING,
                                                 "return_logprob": True, **extra}, timeout=60)


def test_after_a_level_2_sleep_generation_is_a_409_until_weights_are_synced(tmp_path):
    s = ServerProcess(tmp_path, env=ONE_THREAD)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    trainer = ctx.Process(target=sharer_main, args=(theirs,))
    trainer.start()
    try:
        before = _generate(s).json()
        assert httpx.post(f"{s.url}/sleep", params={"level": 2}, timeout=60).status_code == 200
        held = {}
        waiter = threading.Thread(target=lambda: held.update(r=_generate(s)))
        waiter.start()  # sent while asleep: held, then refused at the wake
        time.sleep(0.5)
        assert httpx.post(f"{s.url}/wake_up", timeout=60).status_code == 200
        waiter.join(60)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}
        answers = [held["r"], _generate(s), _generate(s, stream=True),
                   httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 4,
                                                               "logprobs": 2}, timeout=60),
                   httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 4,
                                                               "stream": True}, timeout=60),
                   httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60)]
        for r in answers:
            assert r.status_code == 409 and r.headers["content-type"] == "application/json", r.text
            err = r.json()["error"]
            assert err["code"] == "weights_missing" and err["type"] == "invalid_request_error"
            assert "released by sleep level 2" in err["message"] and "sync weights first" in err["message"]
        health = httpx.get(f"{s.url}/health").json()
        assert health["status"] == "weights_missing" and "sleep level 2" in health["reason"], health
        assert httpx.get(f"{s.url}/health_generate", timeout=60).status_code == 503
        assert ours.poll(120), "the trainer sent nothing"
        r = httpx.post(f"{s.url}/update_weights_from_tensor", json={"serialized_named_tensors": [ours.recv()]},
                       timeout=120)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert httpx.get(f"{s.url}/health").json()["status"] == "ok"
        after = _generate(s).json()
        assert after["output_ids"] == before["output_ids"]
        assert after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    finally:
        ours.send("done")
        trainer.join(30)
        assert s.stop() == 0


def _init(s, port: int, out: dict) -> threading.Thread:
    """``/init_weights_update_group`` for a trainer at ``port`` that never joins, in a thread."""
    def call() -> None:
        t0 = time.monotonic()
        out["r"] = httpx.post(f"{s.url}/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo"}, timeout=600)
        out["seconds"] = time.monotonic() - t0
    t = threading.Thread(target=call)
    t.start()
    return t


def test_a_trainer_that_never_joins_does_not_stop_generation_and_is_answered_at_its_timeout(tmp_path):
    config = CONFIG.replace("shutdown_timeout_s: 20}", "shutdown_timeout_s: 20, weight_sync_timeout_s: 6}")
    s = ServerProcess(tmp_path, config=config, env=ONE_THREAD)
    try:
        out = {}
        t = _init(s, free_port(), out)
        deadline = time.monotonic() + 30
        while httpx.get(f"{s.url}/health").json()["weight_groups"] != {"weight_update_group": "joining"}:
            assert time.monotonic() < deadline, "the join never showed in /health"
            time.sleep(0.1)
        t0 = time.monotonic()
        r = _generate(s)  # the engine steps while the rendezvous waits
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 6 and time.monotonic() - t0 < 5, r.text
        assert t.is_alive()
        t.join(60)
        r = out["r"]
        assert r.status_code == 400 and r.json()["success"] is False, r.text
        assert "timed out after 6 s" in r.json()["message"] and "serve.weight_sync_timeout_s=6" in r.json()["message"]
        assert 5 < out["seconds"] < 30, out["seconds"]
        assert httpx.get(f"{s.url}/health").json()["weight_groups"] == {}
        r = httpx.post(f"{s.url}/destroy_weights_update_group", json={})
        assert r.status_code == 400 and "no weight-update group" in r.json()["message"]  # the name is free again
    finally:
        assert s.stop() == 0


def test_sigterm_while_a_group_is_being_joined_exits_promptly_and_cleanly(tmp_path):
    s = ServerProcess(tmp_path, env=ONE_THREAD)  # the default timeout: 300 s
    out = {}
    t = _init(s, free_port(), out)
    deadline = time.monotonic() + 30
    while httpx.get(f"{s.url}/health").json()["weight_groups"] != {"weight_update_group": "joining"}:
        assert time.monotonic() < deadline, "the join never showed in /health"
        time.sleep(0.1)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0
    assert time.monotonic() - t0 < 30
    t.join(30)
    r = out["r"]
    assert r.status_code == 503 and "was still being joined" in r.json()["message"], r.text
    s.stop()
    assert "Traceback" not in s.log_path.read_text(), s.log_path.read_text()
