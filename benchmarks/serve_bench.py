"""The server under load, and the guarantee through HTTP.

  python3 benchmarks/serve_bench.py load CONFIG [--concurrency 1,16,64,256] [--prompt-len 512]
                                               [--output-len 128]
      C streaming requests at once: TTFT, TPOT and output tok/s through HTTP (a `bi-engine serve`
      process), then the same load through the Python API (one engine in this process, same
      config), side by side. One engine at a time, so a 35B model fits one GPU.
  python3 benchmarks/serve_bench.py invariance CONFIG [--others 255]
      One request alone, then among 255 concurrent others (random lengths, arriving together),
      through HTTP: token ids and logprobs must be bitwise equal (exit 1 if not).

Random token-id prompts (random-weight presets have no tokenizer)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


class Served:
    """A `bi-engine serve` process for the duration of a with-block."""

    def __init__(self, config: str, port: int = 8311) -> None:
        self.config, self.url = config, f"http://127.0.0.1:{port}"
        self.port = port

    def __enter__(self) -> Served:
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "bi_core.cli", "serve", "--config", self.config, "--port",
                                      str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for _ in range(1800):
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: {Path(self.log.name).read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]
                    return self
            except httpx.HTTPError:
                time.sleep(0.5)
        raise SystemExit("server did not start")

    def __exit__(self, exc_type, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(120)
        if exc_type is not None:  # what the server said, when the client side failed
            print(f"server log (tail):\n{Path(self.log.name).read_text()[-3000:]}", file=sys.stderr)


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, int]:
    """(time to first token, time of the last, chunks with text) of one streamed completion."""
    t0, first, last, n = time.perf_counter(), None, None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            # every token comes as a chunk (logprobs=1 asks for them: a random model's tokens often
            # have no text of their own)
            if line.startswith("data: {") and '"finish_reason": null' in line:
                now = time.perf_counter()
                first, last, n = first or now, now, n + 1
    if first is None:
        raise SystemExit(f"no tokens streamed (HTTP {r.status_code})")
    return first - t0, last - t0, n


async def http_load(url: str, model: str, prompts: list[list[int]], output_len: int,
                    warmup: list[list[int]]) -> dict:
    def bodies(ps):
        return [{"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                 "stream": True, "logprobs": 1} for p in ps]
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    # warm-up: the same load on other prompts (kernel compiles and graph captures of these batch
    # sizes happen here; other prompts, so the prefix cache does not serve the measured ones). Its
    # own client: connections left idle past the server's keep-alive timeout would fail on reuse.
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        await asyncio.gather(*(_stream_one(client, url, b) for b in bodies(warmup)))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        bodies = bodies(prompts)
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(_stream_one(client, url, b) for b in bodies))
        wall = time.perf_counter() - t0
    return _summary([r[0] for r in rows], [(r[1] - r[0]) / max(1, output_len - 1) for r in rows],
                    len(prompts) * output_len, wall)


def api_load(config, prompts: list[list[int]], output_len: int, warmup: list[list[int]]) -> dict:
    import torch

    from bi_core import SamplingParams, build_engine

    engine = build_engine(config)
    params = SamplingParams(max_new_tokens=output_len, ignore_eos=True, logprobs=1)  # as the HTTP requests
    engine.generate(warmup, params)  # warm-up: the same load on other prompts (as http_load)
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    first: dict[int, float] = {}
    while engine.scheduler.has_work():
        engine.step()
        now = time.perf_counter()
        for s in seqs:
            if s.output_ids and s.request_id not in first:
                first[s.request_id] = now
    wall = time.perf_counter() - t0
    ttft = [first[s.request_id] - t0 for s in seqs]
    tpot = [(wall - (first[s.request_id] - t0)) / max(1, output_len - 1) for s in seqs]  # upper bound: ends at wall
    del engine
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return _summary(ttft, tpot, len(prompts) * output_len, wall)


def _summary(ttft: list[float], tpot: list[float], tokens: int, wall: float) -> dict:
    return {"ttft_ms_median": statistics.median(ttft) * 1e3, "ttft_ms_p90": sorted(ttft)[int(0.9 * (len(ttft) - 1))] * 1e3,
            "tpot_ms_median": statistics.median(tpot) * 1e3, "output_tok_s": tokens / wall}


def cmd_load(args) -> int:
    from bi_core import EngineConfig

    config = EngineConfig.from_yaml(args.config)
    from bi_core.runtime.engine import resolve_model

    vocab = resolve_model(config)[0].vocab_size
    levels = [int(c) for c in args.concurrency.split(",")]
    results = {}
    for c in levels:
        results[("api", c)] = api_load(config, _prompts(c, args.prompt_len, vocab, c), args.output_len,
                                       _prompts(c, args.prompt_len, vocab, c + 1000))
    with Served(args.config) as s:
        for c in levels:
            results[("http", c)] = asyncio.run(http_load(s.url, s.model, _prompts(c, args.prompt_len, vocab, c),
                                                         args.output_len, _prompts(c, args.prompt_len, vocab, c + 1000)))
    print(f"prompt {args.prompt_len} tokens, {args.output_len} new tokens per request, greedy")
    print(f"{'streams':>7} | {'HTTP TTFT ms':>12} {'TPOT ms':>8} {'tok/s':>9} | {'API TTFT ms':>11} {'TPOT ms':>8} "
          f"{'tok/s':>9} | HTTP/API time")
    for c in levels:
        h, a = results[("http", c)], results[("api", c)]
        print(f"{c:>7} | {h['ttft_ms_median']:12.1f} {h['tpot_ms_median']:8.2f} {h['output_tok_s']:9.1f} | "
              f"{a['ttft_ms_median']:11.1f} {a['tpot_ms_median']:8.2f} {a['output_tok_s']:9.1f} | "
              f"{a['output_tok_s'] / h['output_tok_s']:.3f}x")
    return 0


def needle_body(model: str, request: dict) -> dict:
    """A needle's completion request: logprobs of the sampled tokens, which are named by id."""
    return {"model": model, "max_tokens": 32, "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True,
            **request}


def outcome(response: dict) -> tuple[list[int], list[float]]:
    """A needle's token ids and logprobs: ids, since different tokens may read the same (partial
    UTF-8 bytes all read "\ufffd")."""
    lp = response["choices"][0]["logprobs"]
    ids = []
    for name in lp["tokens"]:
        prefix, _, number = name.partition(":")
        if prefix != "token_id" or not number.isdigit():
            raise SystemExit(f"the server named a token {name!r}, not 'token_id:<id>'")
        ids.append(int(number))
    return ids, lp["token_logprobs"]


def cmd_invariance(args) -> int:
    from bi_core import EngineConfig
    from bi_core.runtime.engine import resolve_model

    vocab = resolve_model(EngineConfig.from_yaml(args.config))[0].vocab_size
    rng = random.Random(1)
    needles = [dict(prompt=p, temperature=t, seed=7) for p in _prompts(4, 300, vocab, 5) for t in (0.0, 0.8)]
    with Served(args.config) as s:
        async def run(batch):
            async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(batch) + 8)) as c:
                outs = await asyncio.gather(*(c.post(f"{s.url}/v1/completions", json=needle_body(s.model, r))
                                              for r in batch))
            return [(*outcome(o.json()), o.headers["x-batch-invariant"]) for o in outs]

        bad = 0
        for i, needle in enumerate(needles):
            alone = asyncio.run(run([needle]))[0]
            others = [dict(prompt=p, temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99))
                      for p in (_prompts(1, rng.randint(1, 1000), vocab, rng.randrange(10**6))[0]
                                for _ in range(args.others))]
            batch = others[: len(others) // 2] + [needle] + others[len(others) // 2:]
            packed = asyncio.run(run(batch))[len(others) // 2]
            same = alone[:2] == packed[:2]
            bad += not same
            print(f"needle {i} (T={needle['temperature']}): alone vs among {args.others}: "
                  f"{'bitwise equal' if same else 'DIFFERENT'} (X-Batch-Invariant: {alone[2]})", flush=True)
    print("PASS" if not bad else f"FAIL: {bad} of {len(needles)} needles differ")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    load = sub.add_parser("load")
    load.add_argument("config")
    load.add_argument("--concurrency", default="1,16,64,256")
    load.add_argument("--prompt-len", type=int, default=512)
    load.add_argument("--output-len", type=int, default=128)
    inv = sub.add_parser("invariance")
    inv.add_argument("config")
    inv.add_argument("--others", type=int, default=255)
    args = ap.parse_args()
    return cmd_load(args) if args.cmd == "load" else cmd_invariance(args)


if __name__ == "__main__":
    sys.exit(main())
