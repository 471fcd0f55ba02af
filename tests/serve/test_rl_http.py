"""An RL trainer's weights and routing through HTTP: a trainer process (``bi_core.rl.WeightSender``,
gloo) sends a second model's weights to a running server through SGLang's and vLLM's routes,
after which the server answers as an engine built from those weights, bitwise; a refused update
changes nothing and reaches the trainer; a checkpoint reload from disk; routed experts in
``/generate`` equal to the Python API's. One torch thread on both sides (bitwise CPU sums)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import torch
import yaml
from serve_helpers import CONFIG, ServerProcess, free_port, httpx

from bi_core import EngineConfig, SamplingParams, build_engine

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PROMPTS = [[5, 17, 200, 3, 9, 41], [7, 7, 1]]
SAMPLING = {"max_new_tokens": 10, "temperature": 0.9, "sampling_seed": 21, "ignore_eos": True}


def config(text: str = CONFIG, seed: int = 0) -> EngineConfig:
    cfg = yaml.safe_load(text)
    cfg["model"]["random"]["seed"] = seed
    return EngineConfig.from_dict(cfg)


def python_api(cfg: EngineConfig, prompts=PROMPTS, **extra) -> list:
    """(ids, logprobs) per prompt from an engine built in this process, on one torch thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = SamplingParams(max_new_tokens=10, temperature=0.9, seed=21, ignore_eos=True, **extra)
        return build_engine(cfg).generate(prompts, params)
    finally:
        torch.set_num_threads(before)


def generate(server, **extra) -> list[dict]:
    r = httpx.post(f"{server.url}/generate", json={"input_ids": PROMPTS, "sampling_params": SAMPLING,
                                                    "return_logprob": True, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(items: list[dict]) -> list:
    return [(i["output_ids"], [e[0] for e in i["meta_info"]["output_token_logprobs"]]) for i in items]


def same(items: list[dict], outs: list) -> bool:
    """The server's ids and logprobs are the Python API's, bitwise."""
    return tokens(items) == [(o.token_ids, o.token_logprobs) for o in outs]


# ------------------------------------------------------------------ the trainer process


def trainer_main(url: str, port: int, seed: int, steps: list[tuple[str, str]], conn, world: int = 2) -> None:
    """A trainer: the seed-``seed`` model's weights, sent step by step through HTTP (``sglang``:
    /update_weights_from_distributed, ``vllm``: /update_weights); each outcome reported."""
    import httpx as client

    from bi_core.errors import BiEngineError
    from bi_core.rl import WeightSender

    torch.set_num_threads(1)
    weights = [(n, p.detach().clone()) for n, p in build_engine(config(seed=seed)).model.named_parameters()]

    def request(route: str, version: int | None):
        def call(names, dtypes, shapes):
            if route == "vllm":
                r = client.post(f"{url}/update_weights", json={"update_info": {
                    "names": names, "dtype_names": dtypes, "shapes": shapes, "packed": True}}, timeout=120)
                ok = r.status_code == 200
            else:
                body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "sgl"}
                r = client.post(f"{url}/update_weights_from_distributed",
                                json={**body, **({"weight_version": version} if version is not None else {})},
                                timeout=120)
                ok = r.status_code == 200 and r.json()["success"] is True
            if not ok:
                raise BiEngineError(f"HTTP {r.status_code}: {r.text}")
            return r.json()
        return call

    group = "sgl" if steps[0][1] == "sglang" else "weight_update_group"
    with WeightSender("127.0.0.1", port, world, group_name=group, timeout_s=60) as sender:
        for case, route in steps:
            pairs = [("model.layers.0.mlp.nonsense.weight", torch.zeros(4))] if case == "bad_name" else weights
            try:
                got = ("ok", sender.send(pairs, request(route, 7 if case == "good_v7" else None), bucket_mb=0.25))
            except BiEngineError as e:
                got = ("error", str(e))
            conn.send((case, got))
            conn.recv()  # the test looked at the server: the next step (or the end)


def start_trainer(url: str, port: int, seed: int, steps, world: int = 2):
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=trainer_main, args=(url, port, seed, steps, theirs, world))
    proc.start()
    return proc, ours


@pytest.fixture(scope="module")
def sync_server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("sync"), env=ONE_THREAD)
    yield s
    s.stop()


def test_weight_sync_from_a_trainer_through_sglangs_then_vllms_routes(sync_server):
    url = sync_server.url
    before = generate(sync_server)
    assert same(before, python_api(config(seed=0)))
    port = free_port()
    trainer, conn = start_trainer(url, port, 1, [("bad_name", "sglang"), ("good_v7", "sglang")])
    try:
        joined = {}
        t = threading.Thread(target=lambda: joined.update(r=httpx.post(f"{url}/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "sgl", "backend": "gloo"}, timeout=120)))
        t.start()
        t0 = time.monotonic()
        while t.is_alive() and time.monotonic() - t0 < 60:  # the HTTP loop answers while the engine waits to join
            assert httpx.get(f"{url}/health", timeout=2).status_code == 200
            time.sleep(0.05)
        t.join()
        assert joined["r"].status_code == 200 and joined["r"].json()["success"] is True, joined["r"].text
        case, (kind, why) = conn.recv()
        assert case == "bad_name" and kind == "error" and "nonsense" in why, why  # the engine's reason, at the trainer
        assert same(generate(sync_server), python_api(config(seed=0)))  # a refused update changed nothing
        conn.send("next")
        case, (kind, body) = conn.recv()
        assert case == "good_v7" and kind == "ok" and body["success"] is True and body["weight_version"] == 7, body
        after = generate(sync_server)
        assert same(after, python_api(config(seed=1)))  # the trainer's weights, bitwise
        assert {i["meta_info"]["weight_version"] for i in after} == {7}
        assert httpx.get(f"{url}/get_weight_version").json() == {"weight_version": 7}
        r = httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": "sgl"})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        conn.send("done")
        trainer.join(60)
        assert trainer.exitcode == 0
    finally:
        if trainer.is_alive():
            trainer.kill()
    # vLLM's names: the seed-0 weights back
    port = free_port()
    trainer, conn = start_trainer(url, port, 0, [("good", "vllm")])
    try:
        r = httpx.post(f"{url}/init_weight_transfer_engine", json={"init_info": {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}}, timeout=120)
        assert r.status_code == 200 and r.json() == {"message": "Weight transfer initialized"}, r.text
        case, (kind, body) = conn.recv()
        assert kind == "ok" and body == {"message": "Weights updated"}, body
        again = generate(sync_server)
        assert same(again, python_api(config(seed=0))) and tokens(again) == tokens(before)
        assert {i["meta_info"]["weight_version"] for i in again} == {8}
        conn.send("done")
        trainer.join(60)
    finally:
        if trainer.is_alive():
            trainer.kill()
    r = httpx.post(f"{url}/destroy_weights_update_group", json={})
    assert r.status_code == 200 and r.json()["success"] is True, r.text


def test_weight_sync_into_a_tensor_parallel_server(tmp_path):
    """Two engine ranks (ranks 1 and 2 of the trainer's group) each take their shard; the server then
    answers as the trainer's model (tokens; the logprobs to float tolerance: the ranks split the sums)."""
    s = ServerProcess(tmp_path, config=CONFIG + "parallel: {tensor_parallel_size: 2}\n", env=ONE_THREAD)
    port = free_port()
    trainer, conn = start_trainer(s.url, port, 1, [("good", "sglang")], world=3)
    try:
        r = httpx.post(f"{s.url}/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3, "group_name": "sgl"},
            timeout=120)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        case, (kind, body) = conn.recv()
        assert kind == "ok" and body["weight_version"] == 1, body
        conn.send("done")
        trainer.join(60)
        got, ref = generate(s), python_api(config(seed=1))
        assert [i["output_ids"] for i in got] == [o.token_ids for o in ref]
        for item, o in zip(got, ref):
            assert np.allclose([e[0] for e in item["meta_info"]["output_token_logprobs"]], o.token_logprobs, atol=1e-4)
        assert httpx.get(f"{s.url}/get_world_size").json() == {"world_size": 2}
    finally:
        if trainer.is_alive():
            trainer.kill()
        assert s.stop() == 0


@pytest.mark.parametrize("path,body,param", [
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1,
                                    "world_size": 2}, "master_port"),
    ("/init_weights_update_group", {"master_port": 29500, "rank_offset": 1, "world_size": 2}, "master_address"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 29500, "rank_offset": 1, "world_size": 2,
                                    "backend": "mpi"}, "backend"),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [2]]}, "dtypes"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                          "weight_version": "v2"}, "weight_version"),
    ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, "names"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                          "load_format": "flattened_bucket"}, "load_format"),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": 3}, "weight_version"),
    ("/update_weights_from_disk", {"model_path": "/x", "flush_cache": False}, "flush_cache"),
    ("/update_weights_from_disk", {}, "model_path"),
])
def test_bad_weight_route_input_is_a_clear_error_in_sglangs_shape(sync_server, path, body, param):
    r = httpx.post(f"{sync_server.url}{path}", json=body)
    got = r.json()
    assert r.status_code == 400 and got["success"] is False and got["message"], r.text
    assert got["error"]["param"] == param and got["error"]["message"] == got["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/init_weight_transfer_engine", {"init_info": {"master_address": "h", "master_port": 1, "rank_offset": 1}},
     "init_info.world_size"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]],
                                         "packed": False}}, "update_info.packed"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": [], "shapes": [[1]]}}, "dtype_names"),
])
def test_bad_vllm_weight_transfer_input_is_a_clear_error(sync_server, path, body, param):
    r = httpx.post(f"{sync_server.url}{path}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_refused_update_with_abort_all_requests_aborts_nothing(sync_server):
    """abort_all_requests aborts once an update has passed its checks: a refused one (no such group;
    an unknown tensor name) leaves a request in flight running to its end (issue 21, item 3)."""
    from bi_core.rl import serialize_named_tensors

    held = [("model.layers.0.mlp.nonsense.weight", torch.zeros(4))]
    stream = httpx.stream("POST", f"{sync_server.url}/generate", json={"input_ids": [1, 2], "stream": True,
                          "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True}}, timeout=120)
    with stream as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        dist = httpx.post(f"{sync_server.url}/update_weights_from_distributed", json={
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "nope",
            "abort_all_requests": True})
        assert dist.status_code == 400 and "no weight-update group 'nope'" in dist.json()["message"], dist.text
        tensor = httpx.post(f"{sync_server.url}/update_weights_from_tensor", json={
            "serialized_named_tensors": [serialize_named_tensors(held)], "abort_all_requests": True}, timeout=60)
        assert tensor.status_code == 400 and "nonsense" in tensor.json()["message"], tensor.text
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and not any('"type": "abort"' in line for line in rest), rest[-2:]
    assert '"type": "length"' in rest[-2], rest[-2]


def test_the_engines_refusal_is_sglangs_failure_shape(sync_server):
    r = httpx.post(f"{sync_server.url}/update_weights_from_distributed", json={
        "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "nope"})
    got = r.json()
    assert r.status_code == 400 and got["success"] is False and "no weight-update group 'nope'" in got["message"], got
    r = httpx.post(f"{sync_server.url}/destroy_weights_update_group", json={"group_name": "nope"})
    assert r.status_code == 400 and r.json()["success"] is False


# ------------------------------------------------------------------ tensors shared by handle (SGLang)

def sharer_main(seed: int, conn) -> None:
    """A colocated trainer: the seed-``seed`` model's weights, shared by handle; held until told."""
    from bi_core.rl import serialize_named_tensors

    weights = [(n, p.detach().clone()) for n, p in build_engine(config(seed=seed)).model.named_parameters()]
    conn.send(serialize_named_tensors(weights))
    conn.recv()


def test_update_weights_from_tensor_through_sglangs_route(tmp_path):
    server = ServerProcess(tmp_path, env=ONE_THREAD)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=sharer_main, args=(2, theirs))
    proc.start()
    try:
        assert ours.poll(120), "the trainer sent nothing"
        payload = ours.recv()
        bad = httpx.post(f"{server.url}/update_weights_from_tensor",
                         json={"serialized_named_tensors": [payload], "load_format": "flattened_bucket"}, timeout=120)
        assert bad.status_code == 400 and bad.json()["success"] is False and "flattened_bucket" in bad.json()["message"]
        r = httpx.post(f"{server.url}/update_weights_from_tensor",
                       json={"serialized_named_tensors": [payload], "weight_version": "4"}, timeout=120)
        assert r.status_code == 200 and r.json()["success"] is True and r.json()["weight_version"] == 4, r.text
        ours.send("done")
        assert same(generate(server), python_api(config(seed=2)))
        r = httpx.post(f"{server.url}/update_weights_from_tensor",
                       json={"serialized_named_tensors": [payload], "disable_draft_model": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "disable_draft_model", r.text
    finally:
        proc.join(30)
        server.stop()


# ------------------------------------------------------------------ a checkpoint reload from disk


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    hf = pytest.importorskip("hf_fixtures")
    tmp = tmp_path_factory.mktemp("ckpt")
    return (hf.save_checkpoint(hf.make_hf_model("dense", seed=0), tmp / "a"),
            hf.save_checkpoint(hf.make_hf_model("dense", seed=1), tmp / "b"))


def test_update_weights_from_disk(checkpoints, tmp_path):
    path_a, path_b = checkpoints
    text = (f"model: {{path: {path_a}, dtype: float32, device: cpu, max_model_len: 512}}\n"
            + CONFIG.split("\n", 2)[2])  # the rest of CONFIG after its model line
    s = ServerProcess(tmp_path, config=text, env=ONE_THREAD)
    try:
        # a request in flight blocks the update, unless it is aborted
        stream = httpx.stream("POST", f"{s.url}/generate", json={"input_ids": [1, 2], "stream": True, "sampling_params": {
            "max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}, timeout=60)
        with stream as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            refused = httpx.post(f"{s.url}/update_weights_from_disk", json={"model_path": str(path_b)})
            assert refused.status_code == 400 and refused.json()["success"] is False
            assert "unfinished" in refused.json()["message"], refused.text
            r2 = httpx.post(f"{s.url}/update_weights_from_disk", json={"model_path": str(path_b),
                                                                         "abort_all_requests": True})
            assert r2.status_code == 200 and r2.json()["success"] is True, r2.text
            assert r2.json()["weight_version"] == 1 and r2.json()["num_paused_requests"] == 0
            rest = [line for line in lines if line.startswith("data: ")]
        assert '"type": "abort"' in rest[-2] and rest[-1] == "data: [DONE]"
        cfg = {**yaml.safe_load(text)}
        cfg["model"]["path"] = str(path_b)
        assert same(generate(s), python_api(EngineConfig.from_dict(cfg)))
        # under the served checkpoint's parent (serve.weights_root's default) only, and only a directory
        missing = httpx.post(f"{s.url}/update_weights_from_disk", json={"model_path": str(path_b.parent / "nope")})
        assert missing.status_code == 400 and missing.json()["success"] is False, missing.text
        assert "does not exist" in missing.json()["message"]
        for outside in (str(tmp_path), "../../..", str(path_b / ".." / "..")):
            r = httpx.post(f"{s.url}/update_weights_from_disk", json={"model_path": outside})
            assert r.status_code == 403 and r.json()["error"]["code"] == "outside_weights_root", r.text
        r = httpx.post(f"{s.url}/update_weights_from_disk", json={"model_path": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model_path", r.text
        assert httpx.get(f"{s.url}/get_weight_version").json() == {"weight_version": 1}
    finally:
        assert s.stop() == 0


# ------------------------------------------------------------------ routed experts


MOE = CONFIG.replace("{random: {preset: tiny-dense, seed: 0}, dtype: float32",
                     "{random: {preset: tiny-moe, seed: 3}, enable_return_routed_experts: true, dtype: float32")


def test_routed_experts_equal_the_python_apis(tmp_path):
    s = ServerProcess(tmp_path, config=MOE, env=ONE_THREAD)
    try:
        items = generate(s, return_routed_experts=True)
        ref = python_api(EngineConfig.from_dict(yaml.safe_load(MOE)), return_routed_experts=True)
        assert same(items, ref)
        import base64

        for item, o in zip(items, ref):
            want = np.asarray(o.routed_experts)
            positions = len(o.prompt_token_ids) + len(o.token_ids) - 1
            assert want.shape[0] == positions and want.ndim == 3
            got = np.frombuffer(base64.b64decode(item["meta_info"]["routed_experts"]), dtype="<i4")
            assert np.array_equal(got.reshape(want.shape), want)
        sliced = generate(s, return_routed_experts=True, routed_experts_start_len=2)
        got = np.frombuffer(base64.b64decode(sliced[0]["meta_info"]["routed_experts"]), dtype="<i4")
        assert np.array_equal(got.reshape(-1, *np.asarray(ref[0].routed_experts).shape[1:]),
                              np.asarray(ref[0].routed_experts)[2:])
        assert "routed_experts" not in generate(s)[0]["meta_info"]  # only when asked
    finally:
        assert s.stop() == 0


def test_routed_experts_on_a_dense_model_are_refused(sync_server):
    r = httpx.post(f"{sync_server.url}/generate", json={"input_ids": [1, 2], "return_routed_experts": True})
    assert r.status_code == 400 and "enable_return_routed_experts" in r.json()["error"]["message"], r.text
