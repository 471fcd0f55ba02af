"""The server's pieces: thread sizing, error params, and serve_bench's invariance check (with one
live request for the token-id names it relies on)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
from serve_helpers import API_KEY, httpx

from bi_core.runtime.threads import available_cores, engine_threads, size_gpu_engine_threads
from bi_core.serve.api_errors import param_of
from bi_core.serve.dev import CollectiveRpcBody
from bi_core.serve.openai_protocol import ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[2]


def _serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "benchmarks" / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_threads_leave_a_core_and_respect_omp_num_threads():
    assert engine_threads(16, 1, {}) == 15
    assert engine_threads(16, 2, {}) == 7  # each tensor-parallel rank
    assert engine_threads(2, 1, {}) == 1 and engine_threads(1, 1, {}) == 1
    assert engine_threads(16, 1, {"OMP_NUM_THREADS": "4"}) is None  # the user's choice stands


def test_a_gpu_engine_takes_one_torch_thread_unless_the_user_chose(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    size_gpu_engine_threads()
    assert calls == [1]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's choice stands
    size_gpu_engine_threads()
    assert calls == [1]


def test_the_engine_process_logs_its_thread_count(server):
    log = server.log_path.read_text()
    line = next((x for x in log.splitlines() if "CPU threads:" in x), None)
    assert line is not None, log
    if os.environ.get("OMP_NUM_THREADS"):
        assert f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} kept" in line
    else:
        assert re.search(rf"\b{max(1, available_cores() - 1)} per engine process\b", line), line


@pytest.mark.parametrize("model,loc,expected", [
    (CompletionRequest, ("max_tokens",), ("max_tokens", None)),
    (CompletionRequest, ("prompt", "list[int]", 0), ("prompt", "list[int]")),
    (CompletionRequest, ("stop_token_ids", 2), ("stop_token_ids[2]", None)),
    (CompletionRequest, ("temprature",), ("temprature", None)),  # an extra field
    (CompletionRequest, ("stream_options", "include_usage"), ("stream_options.include_usage", None)),
    (ChatCompletionRequest, ("messages", 3, "role"), ("messages[3].role", None)),
    (ChatCompletionRequest, ("messages", 0, "content", "str"), ("messages[0].content", "str")),
    (CollectiveRpcBody, ("kwargs", "k"), ("kwargs.k", None)),  # a mapping's key, not a union member
])
def test_param_of_names_the_field_as_openai_does(model, loc, expected):
    assert param_of(model, loc) == expected


def test_serve_bench_invariance_compares_token_ids():
    bench = _serve_bench()

    def response(names: list[str]) -> dict:
        return {"choices": [{"logprobs": {"tokens": names, "token_logprobs": [-1.0] * len(names)}}]}

    # two different byte tokens that both read "\ufffd": same text, different ids
    assert bench.outcome(response(["token_id:200", "token_id:7"])) == ([200, 7], [-1.0, -1.0])
    assert bench.outcome(response(["token_id:200"])) != bench.outcome(response(["token_id:201"]))
    with pytest.raises(SystemExit, match="not 'token_id"):
        bench.outcome(response(["\ufffd"]))  # a server that names tokens by text cannot pass


def test_serve_bench_needles_get_token_ids_from_the_server(server):
    bench = _serve_bench()
    body = bench.needle_body("tiny", {"prompt": [1, 2, 3], "temperature": 0.8, "seed": 7})
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    ids, logprobs = bench.outcome(r.json())
    assert len(ids) == len(logprobs) == 32 and all(0 <= t < 256 for t in ids)
    top = r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert all(f"token_id:{t}" in entry for t, entry in zip(ids, top))  # the sampled token is among them


def _templated_tokenizer(path: Path):
    """A one-character-per-token Hugging Face tokenizer whose chat template renders a message's name."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from bi_core.models.tokenizer import HFTokenizer

    vocab = {c: i for i, c in enumerate(["[UNK]", "<|im_end|>", "\n", *map(chr, range(32, 127))])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tok.chat_template = ("{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}){% endif %}:{{ m.content }}"
                         "<|im_end|>{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    tok.save_pretrained(path)
    return HFTokenizer(path)


def test_a_chat_messages_name_reaches_the_chat_template(tmp_path):
    req = ChatCompletionRequest.model_validate({"model": "tiny", "messages": [
        {"role": "user", "content": "hi", "name": "ann"}, {"role": "developer", "content": "be brief"}]})
    assert req.conversation() == [{"role": "user", "content": "hi", "name": "ann"},
                                  {"role": "system", "content": "be brief"}]
    tokenizer = _templated_tokenizer(tmp_path)
    ids = tokenizer.chat(req.conversation()).ids
    assert ids == tokenizer.encode("user(ann):hi<|im_end|>system:be brief<|im_end|>assistant:")
