"""The server under load, and the guarantee through HTTP.

  python3 benchmarks/serve_bench.py load CONFIG [--concurrency 1,16,64,256] [--prompt-len 512]
                                               [--output-len 128]
      C streaming requests at once: TTFT, TPOT and output tok/s through HTTP (a `bi-engine serve`
      process), then the same load through the Python API (one engine in this process, same
      config), side by side. One engine at a time, so a 35B model fits one GPU.
  python3 benchmarks/serve_bench.py mixed CONFIG [--streams 64] [--prompt-len 512] [--long-len 32000]
      Streams decoding, then one long prompt: its time to first token among them vs on an idle
      server, the streams' inter-token latency (p50, p99) while it prefills vs before, and whether
      its result is the same bits both times (issue 22).
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
    from bi_core.runtime.build import resolve_model

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
    from bi_core.runtime.build import resolve_model

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


async def _stream_times(client: httpx.AsyncClient, url: str, body: dict) -> list[float]:
    """Arrival times (perf_counter) of every token chunk of one streamed completion."""
    times = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"finish_reason": null' in line:
                times.append(time.perf_counter())
    if not times:
        raise SystemExit(f"no tokens streamed (HTTP {r.status_code})")
    return times


async def mixed_load(url: str, model: str, streams: list[list[int]], long: list[int], output_len: int) -> dict:
    """``streams`` decode (streamed, greedy); once every one has its first token, ``long`` arrives
    (one token asked). Its time to first token and result, and the streams' inter-token gaps while
    it prefills vs before it came."""
    body = dict(model=model, temperature=0, ignore_eos=True, logprobs=1, return_tokens_as_token_ids=True)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(streams) + 8)) as client:
        tasks = [asyncio.create_task(_stream_times(client, url, {**body, "prompt": p, "max_tokens": output_len,
                                                                  "stream": True})) for p in streams]
        await asyncio.sleep(0)
        while True:  # every stream decoding: the server's running gauge counts them all
            metrics = (await client.get(f"{url}/metrics")).text
            running = next((float(line.split()[-1]) for line in metrics.splitlines()
                            if line.startswith("bi_requests_running")), 0.0)
            if running >= len(streams):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # a second of steady decode before it: the baseline gaps
        sent = time.perf_counter()
        r = await client.post(f"{url}/v1/completions", json={**body, "prompt": long, "max_tokens": 1})
        first = time.perf_counter()
        times = await asyncio.gather(*tasks)
    gaps_during, gaps_before, ends = [], [], []
    for ts in times:
        for a, b in zip(ts, ts[1:]):
            if sent <= a and b <= first + 0.001:
                gaps_during.append(b - a)
                ends.append((b - sent, b - a))
            elif b < sent and a > sent - 1.0:
                gaps_before.append(b - a)
    return {"ttft_s": first - sent, "long": outcome(r.json()), "gaps_during": gaps_during, "gaps_before": gaps_before,
            "steps": _steps(ends)}


def _steps(ends: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Engine steps seen from the streams: tokens arriving within 5 ms of each other came from one
    step; per step (its end after the long prompt was sent, its longest gap), in order."""
    steps: list[tuple[float, float]] = []
    for end, gap in sorted(ends):
        if steps and end - steps[-1][0] < 0.005:
            steps[-1] = (end, max(steps[-1][1], gap))
        else:
            steps.append((end, gap))
    return steps


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] * 1e3


def cmd_mixed(args) -> int:
    """Issue 22's mixed load through HTTP: the long prompt's time to first token alone and among
    decoding streams, the streams' inter-token latency (p50, p99) while it prefills, and whether
    its result is the same bits in both runs."""
    from bi_core import EngineConfig
    from bi_core.runtime.build import resolve_model

    config = EngineConfig.from_yaml(args.config)
    if config.cache.prefix_caching is not False:
        raise SystemExit("mixed: set cache.prefix_caching: false, or the second run of the long prompt is a "
                         "prefix-cache hit, not a prefill")
    vocab = resolve_model(config)[0].vocab_size
    long = _prompts(1, args.long_len, vocab, 3)[0]
    streams = _prompts(args.streams, args.prompt_len, vocab, 4)
    body = dict(temperature=0, ignore_eos=True, logprobs=1, return_tokens_as_token_ids=True, max_tokens=1)
    with Served(args.config) as s:
        # warm-up: the same shapes on other tokens (kernel compiles, graph captures)
        asyncio.run(mixed_load(s.url, s.model, _prompts(args.streams, args.prompt_len, vocab, 6),
                               _prompts(1, args.long_len, vocab, 7)[0], args.output_len))
        t0 = time.perf_counter()
        alone = httpx.post(f"{s.url}/v1/completions", json={**body, "model": s.model, "prompt": long}, timeout=None)
        idle_ttft = time.perf_counter() - t0
        alone = outcome(alone.json())
        m = asyncio.run(mixed_load(s.url, s.model, streams, long, args.output_len))
    during, before = m["gaps_during"], m["gaps_before"]
    if not during or not before:
        raise SystemExit(f"no inter-token gaps measured ({len(before)} before, {len(during)} during the long "
                         "prefill): raise --output-len so the streams outlast it")
    same = alone == m["long"]
    print(f"{args.streams} streams of {args.prompt_len} tokens decoding, then one {args.long_len}-token prompt")
    print(f"long prompt: time to first token {m['ttft_s'] * 1e3:.1f} ms among the streams, "
          f"{idle_ttft * 1e3:.1f} ms on an idle server ({m['ttft_s'] / idle_ttft:.2f}x); result "
          f"{'bitwise equal' if same else 'DIFFERENT'} (token {m['long'][0]}, logprob {m['long'][1]})")
    print(f"streams' inter-token latency before it: p50 {_pct(before, 0.5):.2f} ms, p99 {_pct(before, 0.99):.2f} ms "
          f"({len(before)} gaps); while it prefills: p50 {_pct(during, 0.5):.2f} ms, p99 {_pct(during, 0.99):.2f} ms, "
          f"max {max(during) * 1e3:.2f} ms ({len(during)} gaps); p99 while / p50 before "
          f"{_pct(during, 0.99) / _pct(before, 0.5):.2f}x")
    print("steps while it prefills (ms after it was sent: the streams' gap): "
          + ", ".join(f"+{end * 1e3:.0f}: {gap * 1e3:.1f}" for end, gap in m["steps"]))
    return 0


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
    mixed = sub.add_parser("mixed")
    mixed.add_argument("config")
    mixed.add_argument("--streams", type=int, default=64)
    mixed.add_argument("--prompt-len", type=int, default=512)
    mixed.add_argument("--long-len", type=int, default=32000)
    mixed.add_argument("--output-len", type=int, default=400)
    args = ap.parse_args()
    return {"load": cmd_load, "invariance": cmd_invariance, "mixed": cmd_mixed}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
