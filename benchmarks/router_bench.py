"""Replicas behind sglang-router on one machine (issue 26): a request's result bitwise the same
from either replica and through the router, and the router's added latency and throughput
against one server at 1, 16 and 64 concurrent streams.

  python3 benchmarks/router_bench.py CONFIG [--replicas 2] [--streams 1,16,64] [--requests 4]
      [--prompt-len 256] [--max-tokens 64] [--policy round_robin] [--vocab 150000]

Each replica is a ``bi-engine serve`` of CONFIG; on a GPU they share it: replica i gets
``cache.gpu_memory_utilization`` (i + 1) / N of CONFIG's, since each counts the ones started
before it as used memory. The single-server baseline is replica 0 alone, asked directly; a second
router in front of replica 0 alone gives the router's own cost apart from the replicas' sharing
of one GPU (two processes time-slice a GPU: the replicas on one H200 do not add throughput). Needs
sglang-router (``pip install 'bi-engine[scale]'``; on the lent GPU ``gpu-deps.sh --router``) and httpx."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from bi_core.scale.processes import free_port, terminate
from bi_core.scale.router import RouterProcess

HOST = "127.0.0.1"


def post(url: str, body: dict, timeout: float = 600.0) -> dict | list:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as r:
            return r.status == 200
    except OSError:
        return False


def start_replica(config: dict, index: int, count: int, tmp: Path) -> tuple[subprocess.Popen, str]:
    cfg = json.loads(json.dumps(config))
    cache = cfg.setdefault("cache", {})
    cache["gpu_memory_utilization"] = cache.get("gpu_memory_utilization", 0.9) * (index + 1) / count
    path = tmp / f"replica{index}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    port = free_port(HOST)
    log = (tmp / f"replica{index}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "bi_core.cli", "serve", "--config", str(path), "--host", HOST,
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 900
    while not healthy(url):  # one at a time: the next one sizes its cache from what is left
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"replica {index} did not come up: {(tmp / f'replica{index}.log').read_text()[-2000:]}")
        time.sleep(1.0)
    return proc, url


def generate(url: str, prompt: list[int], seed: int, max_tokens: int) -> tuple[list[int], list[float]]:
    out = post(f"{url}/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": max_tokens, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}})
    out = out[0] if isinstance(out, list) else out
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def load(url: str, prompts: list[list[int]], streams: int, per_stream: int, max_tokens: int) -> dict:
    """``streams`` clients, each sending ``per_stream`` requests one after another."""
    def client(s: int) -> list[float]:
        times = []
        for r in range(per_stream):
            t0 = time.perf_counter()
            generate(url, prompts[(s * per_stream + r) % len(prompts)], s * 1000 + r, max_tokens)
            times.append(time.perf_counter() - t0)
        return times

    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        lat = sorted(x for times in pool.map(client, range(streams)) for x in times)
    wall = time.perf_counter() - t0
    return {"p50": statistics.median(lat), "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "tok_s": streams * per_stream * max_tokens / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--requests", type=int, default=4, help="requests per stream")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--vocab", type=int, default=150000, help="prompt token ids are drawn below this")
    args = ap.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    tmp = Path(tempfile.mkdtemp(prefix="router-bench-"))
    rng = random.Random(0)
    prompts = [[rng.randrange(args.vocab) for _ in range(args.prompt_len)] for _ in range(64)]
    procs, urls, router, router1 = [], [], None, None
    try:
        t0 = time.perf_counter()
        for i in range(args.replicas):
            proc, url = start_replica(config, i, args.replicas, tmp)
            procs.append(proc)
            urls.append(url)
        router = RouterProcess(HOST, free_port(HOST), args.policy, None, (), tmp / "router.log")
        router.start(urls, timeout_s=120)
        router1 = RouterProcess(HOST, free_port(HOST), args.policy, None, (), tmp / "router1.log")
        router1.start(urls[:1], timeout_s=120)
        print(f"{args.replicas} replicas of {args.config} and sglang-router ({args.policy}) up in "
              f"{time.perf_counter() - t0:.0f} s")
        # every replica and the router give each request the same bits
        checks = [(p, 7 + i) for i, p in enumerate(prompts[:8])]
        want = [generate(urls[0], p, s, args.max_tokens) for p, s in checks]
        same = {name: sum(generate(url, p, s, args.max_tokens) == w for (p, s), w in zip(checks, want))
                for name, url in [*((f"replica {i}", u) for i, u in enumerate(urls[1:], 1)), ("router", router.url)]}
        print("bitwise equal to replica 0: " + ", ".join(f"{k} {v}/{len(checks)}" for k, v in same.items()))
        cols = ["one server", "router, replica 0 only", f"router, {args.replicas} replicas"]
        print(f"{'streams':>7} | " + " | ".join(f"{c + ' p50 / p99 s':>34} {'tok/s':>7}" for c in cols)
              + " | router(1) / one: p50 x, tok/s x | router(N) / one: tok/s x")
        for streams in (int(s) for s in args.streams.split(",")):
            res = [load(url, prompts, streams, args.requests, args.max_tokens)
                   for url in (urls[0], router1.url, router.url)]
            one, via1, via = res
            print(f"{streams:>7} | " + " | ".join(f"{r['p50']:>22.3f} / {r['p99']:<9.3f} {r['tok_s']:>7.0f}" for r in res)
                  + f" | {via1['p50'] / one['p50']:.3f}x, {via1['tok_s'] / one['tok_s']:.3f}x"
                  f" | {via['tok_s'] / one['tok_s']:.3f}x", flush=True)
    finally:
        for r in (router, router1):
            if r is not None:
                r.stop(10)
        for proc in procs:
            terminate(proc, 30)


if __name__ == "__main__":
    main()
