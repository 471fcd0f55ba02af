"""Two lone ``bi-engine serve`` replicas behind the released sglang-router, driven by the official
openai client: the router's answers are the ones a lone server gives (greedy and seeded
sampling, completions, chat and SGLang's /generate), and cache-aware routing keeps a shared
prefix on one replica (prefix-cache hits read from the replicas' /metrics) where round robin
spreads it."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("sglang_router")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from scale_helpers import MODEL, Server, finished, metric, wait_until  # noqa: E402

from bi_core.scale.router import RouterProcess  # noqa: E402

HITS = 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"}'
QUERIES = 'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"}'


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    servers = [Server(tmp / f"r{i}") for i in range(2)]
    try:
        yield [s.wait() for s in servers]
    finally:
        for s in servers:
            assert s.stop() == 0


def start_router(tmp, replicas, policy: str) -> RouterProcess:
    from scale_helpers import free_port

    router = RouterProcess("127.0.0.1", free_port(), policy, None, (), tmp / f"router-{policy}.log")
    router.start([s.url for s in replicas], 60)
    return router


@pytest.fixture(scope="module")
def round_robin(replicas, tmp_path_factory):
    router = start_router(tmp_path_factory.mktemp("router"), replicas, "round_robin")
    yield router
    router.stop(30)


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def ask(url: str) -> list:
    """The same requests, one at a time (each alone in its batch): what comes back, bit for bit."""
    c, out = client(url), []
    for i in range(3):
        r = c.completions.create(model=MODEL, prompt=f"Replica {i} says", max_tokens=8, temperature=0, logprobs=2)
        out.append((r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.choices[0].logprobs.top_logprobs))
        r = c.completions.create(model=MODEL, prompt=f"Sample {i}:", max_tokens=8, temperature=0.9, seed=100 + i, n=2,
                                 logprobs=0)
        out.append([(ch.text, ch.logprobs.token_logprobs) for ch in r.choices])
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"chat {i}"}], max_tokens=6,
                                      temperature=0.7, seed=7, logprobs=True, top_logprobs=1)
        out.append((r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]))
    r = httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": {
        "max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3}, "return_logprob": True}, timeout=60)
    assert r.status_code == 200, r.text
    out.append((r.json()["output_ids"], r.json()["meta_info"]["output_token_logprobs"]))
    return out


def test_the_router_answers_as_a_lone_server_does(replicas, round_robin):
    alone = ask(replicas[0].url)
    before = [finished(s.url) for s in replicas]
    routed = ask(round_robin.url)
    served = [finished(s.url) - b for s, b in zip(replicas, before)]
    assert all(n >= 3 for n in served), f"round robin should spread the requests over both replicas: {served}"
    assert routed == alone


def test_the_router_lists_the_served_model_and_the_replicas_loads(replicas, round_robin):
    models = client(round_robin.url).models.list()
    assert [m.id for m in models.data] == [MODEL]  # the router took it from the workers' /server_info
    loads = httpx.get(f"{round_robin.url}/get_loads", timeout=10).json()
    assert sorted(w["worker"] for w in loads["workers"]) == sorted(s.url for s in replicas)
    assert all(w["load"] == 0 for w in loads["workers"])  # idle: no running request holds a token


def prefix_hits(replicas, tmp, policy: str) -> tuple[float, float]:
    """Three groups of four prompts, each group sharing a 64-token prefix (4 chunks of 16) and
    interleaved (g0 g1 g2 g0 ...), sent one at a time through a router with ``policy``; the prefix-cache
    hits and queries (tokens) the replicas counted."""
    for s in replicas:
        assert httpx.post(f"{s.url}/flush_cache", timeout=10).status_code == 200
    router = start_router(tmp, replicas, policy)
    try:
        before = [(metric(s.url, HITS), metric(s.url, QUERIES)) for s in replicas]
        c = client(router.url)
        for k in range(4):
            for g in "ABC":
                prompt = g * 8 + f" shared system prompt number {g} for all " + "." * 20 + f" question {k}{g}"
                assert len(prompt.encode()) >= 64 + 8
                c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        after = [(metric(s.url, HITS), metric(s.url, QUERIES)) for s in replicas]
    finally:
        router.stop(30)
    return sum(a[0] - b[0] for a, b in zip(after, before)), sum(a[1] - b[1] for a, b in zip(after, before))


def test_cache_aware_routing_keeps_a_prefix_on_one_replica(replicas, tmp_path):
    aware, aware_queries = prefix_hits(replicas, tmp_path, "cache_aware")
    spread, spread_queries = prefix_hits(replicas, tmp_path, "round_robin")
    assert aware_queries == spread_queries > 0
    # cache-aware: after each group's first prompt every one hits its 64 tokens (3 groups x 3 x 64);
    # round robin alternates, so each replica sees each group twice: one hit per replica and group
    assert aware == 3 * 3 * 64, aware
    assert spread == 3 * 2 * 64, spread


def test_a_request_for_another_model_is_refused_by_name(round_robin):
    with pytest.raises(openai.NotFoundError) as e:
        client(round_robin.url).completions.create(model="other", prompt="x", max_tokens=1)
    assert "other" in str(e.value)


def test_a_removed_replica_gets_no_more_requests(replicas, tmp_path):
    router = start_router(tmp_path, replicas, "round_robin")
    try:
        assert router.remove(replicas[1].url)
        wait_until(lambda: [w["url"] for w in router.workers()] == [replicas[0].url], 10, "removal")
        before = [finished(s.url) for s in replicas]
        for i in range(4):
            client(router.url).completions.create(model=MODEL, prompt=f"only {i}", max_tokens=2, temperature=0)
        assert [finished(s.url) - b for s, b in zip(replicas, before)] == [4, 0]
        router.add(replicas[1].url)
        wait_until(lambda: len([w for w in router.workers() if w["is_healthy"]]) == 2, 10, "re-adding")
    finally:
        router.stop(30)


def test_an_api_key_guards_the_router_and_reaches_the_replicas(tmp_path):
    """With serve.api_key, the router takes the clients' key, sends it to the replicas (its discovery
    calls, a worker added later, the requests it forwards) and its worker API wants it too."""
    from scale_helpers import free_port

    servers = [Server(tmp_path / f"k{i}", "--api-key", "sekrit") for i in range(2)]
    router = None
    try:
        for s in servers:
            s.wait()
        router = RouterProcess("127.0.0.1", free_port(), "round_robin", "sekrit", (), tmp_path / "router.log")
        router.start([servers[0].url], 60)
        router.add(servers[1].url)
        wait_until(lambda: len([w for w in router.workers() if w["is_healthy"]]) == 2, 10, "adding")
        assert {w["model_id"] for w in router.workers()} == {MODEL}  # its /server_info was read with the key
        keyed = openai.OpenAI(base_url=f"{router.url}/v1", api_key="sekrit", max_retries=0, timeout=60)
        before = [finished(s.url) for s in servers]
        for i in range(2):
            keyed.completions.create(model=MODEL, prompt=f"key {i}", max_tokens=2, temperature=0)
        assert [finished(s.url) - b for s, b in zip(servers, before)] == [1, 1]
        with pytest.raises(openai.AuthenticationError):
            client(router.url).completions.create(model=MODEL, prompt="no key", max_tokens=2)
        assert httpx.get(f"{router.url}/workers", timeout=10).status_code == 401
    finally:
        if router is not None:
            router.stop(30)
        for s in servers:
            assert s.stop() == 0


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {"prompt": "x", "return_hidden_states": True}, 400, "return_hidden_states"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream_reasoning": False}, 400,
     "stream_reasoning"),
    ("/generate", {"text": "x", "return_entropy": True}, 400, "return_entropy"),
    ("/generate", {"text": "x", "model": "other"}, 404, "model"),
])
def test_the_router_fields_are_taken_only_where_they_change_nothing(replicas, path, body, status, param):
    """What the router adds to a request is accepted at its no-op value (the tests above pass through
    the router); any other value is refused by name, never ignored."""
    if path != "/generate":
        body = {"model": MODEL, "max_tokens": 2, **body}
    r = httpx.post(f"{replicas[0].url}{path}", json=body, timeout=30)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
