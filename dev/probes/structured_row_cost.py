"""Host time a step spends on its constrained rows (CPU): the grammar masks (xgrammar) and the
sampler's work on them, at B rows of Qwen3.5's vocabulary size, against the same rows plain.

  python3 dev/probes/structured_row_cost.py [--batch-sizes 1,8,64] [--steps 20]

Parts: ``masks`` the rows' ``GrammarState`` masks (``sampling_batch``: one fresh tensor a row),
``fill`` the same masks written into one staging buffer by ``fill_rows`` (xgrammar's
``BatchGrammarMatcher``: what the device path does), ``sampler`` the reference sampler over [B, V] float32 logits with the masks
vs without them. The matchers walk a valid JSON document, so every step's masks are real ones."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from grammar_mask_bench import DOC, EOS, SCHEMA, SPECIAL_START, VOCAB, qwen_vocab, synthetic_vocab  # noqa: E402

from bi_core.backends.reference.sampling import ReferenceSamplerImpl  # noqa: E402
from bi_core.ops.sampling import LogitsAdjust, SamplingBatch  # noqa: E402
from bi_core.structured import json_schema  # noqa: E402
from bi_core.structured.grammars import Grammars, fill_rows  # noqa: E402


class VocabTokenizer:
    """The two methods ``Grammars`` reads, over a list of token bytes."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens = tokens

    def special_ids(self) -> set[int]:
        return set(range(SPECIAL_START, VOCAB))

    def token_bytes(self, i: int) -> bytes:
        return self.tokens[i]


def doc_tokens(tokens: list[bytes], text: bytes) -> list[int]:
    """Greedy longest-match tokenization of ``text`` (as the mask bench walks it)."""
    index = {t: i for i, t in enumerate(tokens) if t}
    out, at = [], 0
    while at < len(text):
        for n in range(min(16, len(text) - at), 0, -1):
            if text[at:at + n] in index:
                out.append(index[text[at:at + n]])
                at += n
                break
        else:
            raise ValueError("untokenizable")
    return out


def timed(fn, steps: int) -> float:
    t0 = time.perf_counter()
    for s in range(steps):
        fn(s)
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="fill_rows' threads (0: half the cores, at most 8)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokens = qwen_vocab() or synthetic_vocab(SPECIAL_START)
    tokens = tokens + [b""] * (VOCAB - len(tokens))
    grammars = Grammars(VocabTokenizer(tokens), VOCAB, EOS)
    spec = json_schema(SCHEMA, any_whitespace=False)
    doc = doc_tokens(tokens, json.dumps(DOC, separators=(",", ":")).encode())
    words = (VOCAB + 31) // 32
    sampler = ReferenceSamplerImpl()
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        states = [grammars.state(spec) for _ in range(b)]
        steps = min(args.steps, len(doc) - 1)
        masks_ms = timed(lambda s, st=states: [g.mask(doc[:s]) for g in st], steps)
        states = [grammars.state(spec) for _ in range(b)]
        buf = torch.empty((b, words), dtype=torch.int32)
        fill_ms = timed(lambda s, st=states, o=buf: fill_rows([(g, doc[:s]) for g in st], o, args.threads), steps)
        logits = torch.randn(b, VOCAB)
        masks = [g.mask(doc[:5]) for g in states]
        plain = SamplingBatch(temperatures=[0.8] * b, top_ks=[0] * b, top_ps=[1.0] * b, keys=list(range(b)),
                              num_logprobs=0)
        masked = SamplingBatch(temperatures=[0.8] * b, top_ks=[0] * b, top_ps=[1.0] * b, keys=list(range(b)),
                               num_logprobs=0, adjust=[LogitsAdjust(allowed=m) for m in masks])
        plain_ms = timed(lambda s, x=logits, p=plain: sampler.forward(x, p), 3)
        masked_ms = timed(lambda s, x=logits, m=masked: sampler.forward(x, m), 3)
        print(json.dumps({"batch": b, "masks_ms": round(masks_ms, 3), "fill_ms": round(fill_ms, 3),
                          "sampler_plain_ms": round(plain_ms, 2), "sampler_masked_ms": round(masked_ms, 2),
                          "vocab": "qwen3.5" if qwen_vocab() else "synthetic"}), flush=True)


if __name__ == "__main__":
    main()
