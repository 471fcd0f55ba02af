"""OpenAI-API clients against a real server: lm-evaluation-harness's ``local-completions``
(loglikelihood through echo, generate_until, its remote-tokenizer probe), guidellm's and aiperf's
streaming benchmarks (usage in every chunk with ``continuous_usage_stats``), and the openai SDK
itself. The echoed prompt logprobs are checked bitwise against the Python API's prompt logprobs."""

from __future__ import annotations

import bodies
import pytest
from replay import events, send

from bi_core import SamplingParams
from bi_core.models.tokenizer import ByteTokenizer

openai = pytest.importorskip("openai")
BYTES = ByteTokenizer()  # the embedded model's tokenizer


def _loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs for one choice."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


def test_lm_eval_loglikelihood_echoes_the_prompts_logprobs_bitwise(client_server, engine):
    r = send(client_server, bodies.LM_EVAL_LOGLIKELIHOOD)
    assert r.status_code == 200, r.text
    prompts = bodies.LM_EVAL_LOGLIKELIHOOD[2]["prompt"]
    refs = engine.generate(prompts, SamplingParams(max_new_tokens=1, temperature=0, seed=1234, logprobs=1,
                                                   prompt_logprobs=1))  # both in one step, as the server ran them
    ctxlen = len(bodies.CONTEXT)
    for choice, ids, ref in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), prompts, refs):
        lp = choice["logprobs"]
        assert choice["text"] == bytes(ids).decode() + ref.text  # echo: the prompt, then the generated token
        assert lp["tokens"][:len(ids)] == [chr(t) for t in ids] and len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"] == [None] + [ref.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))] \
            + ref.token_logprobs
        assert lp["top_logprobs"][0] is None and lp["text_offset"] == list(range(len(ids) + 1))
        for p in range(1, len(ids)):
            best = max(ref.prompt_logprobs[p].values())
            assert max(lp["top_logprobs"][p].values()) == best  # lm-eval's greedy check reads this
        total, greedy = _loglikelihood(choice, ctxlen)
        assert total == sum(ref.prompt_logprobs[p][ids[p]] for p in range(ctxlen, len(ids)))
        assert greedy == all(ref.prompt_logprobs[p][ids[p]] == max(ref.prompt_logprobs[p].values())
                             for p in range(ctxlen, len(ids)))
    assert r.json()["usage"]["completion_tokens"] == 2


def test_lm_eval_loglikelihood_without_generation(client_server, engine):
    r = send(client_server, bodies.LM_EVAL_LOGLIKELIHOOD_NO_GENERATION)
    assert r.status_code == 200, r.text
    ids = bodies.LM_EVAL_LOGLIKELIHOOD_NO_GENERATION[2]["prompt"][0]
    ref = engine.generate([ids], SamplingParams(max_new_tokens=1, temperature=0, seed=1234, logprobs=1,
                                                prompt_logprobs=1))[0]
    choice = r.json()["choices"][0]
    assert choice["text"] == bytes(ids).decode() and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None] + [ref.prompt_logprobs[p][ids[p]] for p in range(1, len(ids))]
    assert len(choice["logprobs"]["top_logprobs"]) == len(ids)
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                                 "prompt_tokens_details": {"cached_tokens": 0}}


def test_lm_eval_generate_until(client_server):
    r = send(client_server, bodies.LM_EVAL_GENERATE_UNTIL)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]  # lm-eval places texts by index


def test_lm_eval_remote_tokenizer_probe(client_server):
    """check_remote_tokenizer_support: no /tokenizer_info (vLLM's is opt-in), so lm-eval falls back
    to its own tokenizer; /tokenize and /detokenize answer its bodies all the same."""
    assert send(client_server, bodies.LM_EVAL_TOKENIZER_INFO).status_code == 404
    tok = send(client_server, bodies.LM_EVAL_TOKENIZE)
    assert tok.status_code == 200 and tok.json() == {"count": 4, "max_model_len": 512, "tokens": [116, 101, 115, 116],
                                                     "token_strs": None}, tok.text
    detok = send(client_server, bodies.LM_EVAL_DETOKENIZE)
    assert detok.status_code == 200 and detok.json() == {"prompt": "test"}, detok.text


def _usage_per_chunk(evs: list) -> list:
    return [e.get("usage") for e in evs[:-1]]


@pytest.mark.parametrize("request_,chat", [(bodies.GUIDELLM_COMPLETIONS, False), (bodies.GUIDELLM_CHAT, True),
                                           (bodies.AIPERF_CHAT, True)], ids=["guidellm-completions", "guidellm-chat",
                                                                             "aiperf-chat-per-chunk-usage"])
def test_continuous_usage_stats_put_usage_in_every_chunk(client_server, request_, chat):
    r, evs = events(client_server, request_)
    assert r.status_code == 200 and evs[-1] == "[DONE]"
    usages = _usage_per_chunk(evs)
    assert all(u is not None for u in usages), usages  # vLLM's continuous usage: every chunk
    prompt = usages[-1]["prompt_tokens"]
    counts = [u["completion_tokens"] for u in usages[:-1]]
    assert counts == sorted(counts) and all(u["prompt_tokens"] == prompt for u in usages)
    assert evs[-2]["choices"] == [] and counts[-1] == usages[-1]["completion_tokens"] > 0  # the final usage chunk
    text = "".join((c["delta"].get("content") or "") + (c["delta"].get("reasoning_content") or "") if chat else c["text"]
                   for e in evs[:-2] for c in e["choices"])  # Qwen3.5's template opens <think>: reasoning first
    assert len(text) > 0


def test_aiperf_completions_usage_in_the_last_chunk_only(client_server):
    r, evs = events(client_server, bodies.AIPERF_COMPLETIONS)
    assert r.status_code == 200 and evs[-1] == "[DONE]"
    assert all("usage" not in e for e in evs[:-2]) and 0 < evs[-2]["usage"]["completion_tokens"] <= 6


def test_aiperf_plain_chat(client_server):
    r = send(client_server, bodies.AIPERF_CHAT_PLAIN)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
    assert r.json()["usage"]["completion_tokens"] <= 6


def _sdk(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_openai_sdk_models_usage_and_metadata(client_server):
    c = _sdk(client_server)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("other")
    long = list(range(40, 120))  # 80 tokens: two whole 32-token chunks to cache
    first = c.completions.create(model="tiny", prompt=long, max_tokens=2, temperature=0)
    again = c.completions.create(model="tiny", prompt=long, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    assert first.choices[0].text == again.choices[0].text
    assert again.model_extra["metadata"] == {"weight_version": "0"}  # SGLang's weight version
    chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi", "name": "ann"}],
                                            max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens <= 3 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert chunks[-2].model_extra["metadata"] == {"weight_version": "0"}
    # the SDK types metadata as {str: str}: a response it validates strictly must carry a string
    strict = openai.OpenAI(base_url=f"{client_server.url}/v1", api_key="unused", max_retries=0,
                           _strict_response_validation=True)
    chat = strict.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.metadata == {"weight_version": "0"}


def test_openai_sdk_stream_options_need_a_stream(client_server):
    with pytest.raises(openai.BadRequestError) as e:
        _sdk(client_server).completions.create(model="tiny", prompt="x", max_tokens=2,
                                               stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


def test_openai_sdk_echo_and_vllm_prompt_logprobs(client_server, engine):
    ids = bodies.CONTEXT
    r = _sdk(client_server).completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0,
                                               extra_body={"prompt_logprobs": 2})
    ref = engine.generate([ids], SamplingParams(max_new_tokens=1, temperature=1.0, prompt_logprobs=2))[0]
    choice = r.choices[0]
    assert choice.text == bytes(ids).decode() and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.top_logprobs[1] == {chr(ids[1]): ref.prompt_logprobs[1][ids[1]]}  # logprobs 0: the token
    prompt_lps = choice.model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ids)
    for p in range(1, len(ids)):
        entry = ref.prompt_logprobs[p]
        top2 = list(entry)[:2]
        assert set(prompt_lps[p]) == {str(t) for t in {*top2, ids[p]}}
        assert prompt_lps[p][str(ids[p])]["logprob"] == entry[ids[p]]
        for rank, t in enumerate(top2, 1):
            assert prompt_lps[p][str(t)] == {"logprob": entry[t], "rank": rank, "decoded_token": BYTES.decode([t])}
