"""vLLM's LoRA routes and request fields on a real server: /v1/load_lora_adapter and
/v1/unload_lora_adapter (paths only under serve.weights_root, load_inplace as a new version,
every slot taken: a 400), a request naming its adapter by ``model`` (vLLM; completions, chat and
/v1/responses) or ``lora_path`` (SGLang's /generate), /v1/models listing adapters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from serve_helpers import CONFIG, ServerProcess, httpx

from bi_core import EngineConfig, build_engine

sys.path.insert(0, str(Path(__file__).parent))
from lora_fixtures import random_adapter, save_adapter  # noqa: E402

LORA_CONFIG = CONFIG.replace("serve: {model_name: tiny, shutdown_timeout_s: 20}",
                             "serve: {model_name: tiny, shutdown_timeout_s: 20, weights_root: ROOT}\n"
                             "lora: {max_loras: 2, max_rank: 8}")
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_http")
    config = LORA_CONFIG.replace("ROOT", str(tmp))
    engine = build_engine(EngineConfig.from_dict({**__import__("yaml").safe_load(config), "serve": {}}))
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        save_adapter(tmp / "adapters" / name, *random_adapter(engine, r=8, seed=seed, scale=2.0))
    s = ServerProcess(tmp, config=config)
    yield s
    s.stop()


def tokens(server, **fields):
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 6, "logprobs": 0, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == fields["model"]  # vLLM answers with the model the request named
    return r.json()["choices"][0]["logprobs"]["token_logprobs"]


def post(server, route, body):
    return httpx.post(f"{server.url}{route}", json=body, timeout=60)


def test_load_serve_replace_and_unload(server):
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "adapters/a"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' added successfully."
    cards = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [("tiny", None), ("a", "tiny")]
    base, with_a = tokens(server, model="tiny"), tokens(server, model="a")
    assert with_a != base  # the adapter reaches the answer
    gen = post(server, "/generate", {"input_ids": PROMPT, "lora_path": "a", "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert [e[0] for e in gen["meta_info"]["output_token_logprobs"]] == with_a
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "adapters/b"})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    inplace = post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "adapters/b", "load_inplace": True})
    assert inplace.status_code == 200
    assert tokens(server, model="a") != with_a  # its next version serves new requests
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "adapters/b"}).status_code == 200
    full = post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "adapters/c"})
    assert full.status_code == 400 and "lora.max_loras=2" in full.json()["error"]["message"]
    missing = post(server, "/v1/unload_lora_adapter", {"lora_name": "zzz"})
    assert missing.status_code == 404
    r = post(server, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a' removed successfully."
    assert post(server, "/v1/completions", {"prompt": PROMPT, "model": "a"}).status_code == 404
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": "adapters/c"}).status_code == 200


def test_bad_paths_and_names(server):
    outside = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"})
    assert outside.status_code == 403 and outside.json()["error"]["param"] == "lora_path"
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nope"}).status_code == 400
    unknown = post(server, "/generate", {"input_ids": PROMPT, "lora_path": "nope"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "lora_path"
    extra = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "adapters/a", "bogus": 1})
    assert extra.status_code == 400


def test_sglang_routes_and_adapter_sync_by_handle(server, tmp_path):
    """SGLang's /load_lora_adapter, /unload_lora_adapter and /load_lora_adapter_from_tensors: the
    tensors pushed by shared-memory handle become the name's next version, whose tokens are those of
    the same tensors loaded from disk under another name."""
    import json

    from safetensors.torch import load_file

    from bi_core.rl import serialize_named_tensors

    for name in list(httpx.get(f"{server.url}/v1/models").json()["data"])[1:]:
        assert post(server, "/unload_lora_adapter", {"lora_name": name["id"]}).json()["success"] is True
    r = post(server, "/load_lora_adapter", {"lora_name": "s", "lora_path": "adapters/a"}).json()
    assert r["success"] is True and r["error_message"] is None and list(r["loaded_adapters"]) == ["s"]
    dup = post(server, "/load_lora_adapter", {"lora_name": "s", "lora_path": "adapters/a"})
    assert dup.status_code == 400 and dup.json()["success"] is False
    before = tokens(server, model="s")
    b_dir = Path(server.log_path).parent / "adapters" / "b"
    tensors = load_file(str(b_dir / "adapter_model.safetensors"))
    config = json.loads((b_dir / "adapter_config.json").read_text())
    pushed = post(server, "/load_lora_adapter_from_tensors", {"lora_name": "s", "config_dict": config,
                                                              "serialized_tensors": serialize_named_tensors(tensors)})
    assert pushed.status_code == 200 and pushed.json()["success"] is True, pushed.text
    after = tokens(server, model="s")
    assert post(server, "/load_lora_adapter", {"lora_name": "t", "lora_path": "adapters/b"}).status_code == 200
    assert after != before and after == tokens(server, model="t")
    bad = post(server, "/load_lora_adapter_from_tensors", {"lora_name": "s", "config_dict": config,
                                                           "serialized_tensors": "bm90IGEgcGlja2xl"})
    assert bad.status_code == 400 and bad.json()["success"] is False


def test_chat_and_responses_run_on_the_adapter_model_names(server):
    """/v1/chat/completions and /v1/responses with ``model`` an adapter's name: the tokens are the
    adapter's (those of the rendered prompt completed under it), not the base model's."""
    for card in list(httpx.get(f"{server.url}/v1/models").json()["data"])[1:]:
        assert post(server, "/v1/unload_lora_adapter", {"lora_name": card["id"]}).status_code == 200
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "adapters/a"}).status_code == 200
    messages = [{"role": "user", "content": "Hi"}]

    def chat(model):
        r = post(server, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 6,
                                                  "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["model"] == model, r.text
        return r.json()["choices"][0]

    def respond(model):
        r = post(server, "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == model, r.text
        return "".join(p["text"] for item in r.json()["output"] for p in item.get("content") or [])

    ids = post(server, "/v1/chat/completions/render", {"model": "a", "messages": messages}).json()["token_ids"]
    completed = post(server, "/v1/completions", {"model": "a", "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                 "logprobs": 0, "return_tokens_as_token_ids": True}).json()
    completed_ids = [int(t.split(":")[1]) for t in completed["choices"][0]["logprobs"]["tokens"]]
    on_a, on_base = chat("a"), chat("tiny")
    assert on_a["token_ids"] == completed_ids != on_base["token_ids"]
    text = lambda c: (c["message"].get("reasoning_content") or "") + (c["message"].get("content") or "")  # noqa: E731
    assert respond("a") == text(on_a) != respond("tiny") == text(on_base)
    assert post(server, "/v1/responses", {"model": "zzz", "input": "Hi"}).status_code == 404
