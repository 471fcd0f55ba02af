"""Grammars for structured outputs, through xgrammar (the optional extra ``structured``).

``check(spec)`` compiles a spec's grammar without a vocabulary (the HTTP side's 400s). ``Grammars``
is the engine's: the vocabulary as xgrammar reads it (each token's bytes; special tokens are
never allowed, EOS only where the grammar may end), compiled grammars cached by spec (compiled
on a small thread pool: ``prepare``),
and a ``GrammarState`` per sequence. A state is derived from the sequence's own output tokens
alone: it replays them into a matcher of its own (never shared between sequences, n samples
included), and catches up with whatever tokens came since, so a preempted or forked sequence has
the state its tokens give. A row's mask is that state's (after an MTP verify row's drafts before
it, on a copy), so it depends on the request alone (G1)."""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from bi_core.errors import RequestError
from bi_core.structured.specs import StructuredSpec, choice_grammar, is_lark
from bi_core.structured.tool_calls import structural_tag

EXTRA = "structured"
MAX_CACHED = 256  # compiled grammars kept (least recently used dropped first)
COMPILE_THREADS = 2  # grammars compiled at once, off the engine's thread (each compile uses xgrammar's threads too)
_SOURCE_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def xgrammar():
    """The xgrammar module, or one RequestError naming the extra to install."""
    try:
        import xgrammar
    except ImportError:
        raise RequestError("structured outputs need the optional package xgrammar, which is not installed: "
                           f"pip install 'bi-engine[{EXTRA}]'") from None
    return xgrammar


def _reason(e: Exception) -> str:
    """xgrammar's message without its source location."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return _SOURCE_PREFIX.sub("", lines[0]) if lines else type(e).__name__


def grammar_of(xgr, spec: StructuredSpec):
    """The spec's ``xgrammar.Grammar`` (no vocabulary needed)."""
    G, value = xgr.Grammar, spec.value
    if spec.kind in ("json_schema", "json_object"):
        # compact separators without whitespace (xgrammar's own default then is ", " and ": ")
        return G.from_json_schema(value if spec.kind == "json_schema" else '{"type": "object"}',
                                  any_whitespace=spec.any_whitespace, strict_mode=True,
                                  separators=None if spec.any_whitespace else (",", ":"))
    if spec.kind == "regex":
        return G.from_regex(value)
    if spec.kind == "choice":
        return G.from_ebnf(choice_grammar(json.loads(value)))
    if spec.kind == "grammar":
        return G.from_lark(value) if is_lark(value) else G.from_ebnf(value)
    return G.from_structural_tag(structural_tag(xgr, value))


def _compile_error(spec: StructuredSpec, e: Exception) -> RequestError:
    return RequestError(f"structured outputs: the {spec.kind.replace('_', ' ')} does not compile: {_reason(e)}")


def check(spec: StructuredSpec) -> None:
    """Raise one RequestError naming the problem if the spec's grammar does not compile."""
    xgr = xgrammar()
    try:
        grammar_of(xgr, spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise _compile_error(spec, e) from None


def vocabulary(tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes as a grammar matches them: b"" (never allowed, EOS aside) for special
    tokens, whose text ``skip_special_tokens`` drops (so the text always holds what the grammar
    matched), and for ids the tokenizer does not know (the embedding's padding). Tokens such as
    Qwen's ``<tool_call>`` are not special: a grammar matches them as their text."""
    special = tokenizer.special_ids()
    out = []
    for i in range(vocab_size):
        try:
            out.append(b"" if i in special else tokenizer.token_bytes(i))
        except (IndexError, KeyError, ValueError, TypeError, OverflowError):
            out.append(b"")
    return out


class Grammars:
    """The engine's grammar compiler (built at the first structured request) and its cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Seq[int], max_cached: int = MAX_CACHED) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, tuple(eos_ids)
        self.max_cached = max_cached
        self._xgr = self._compiler = None
        self._cache: OrderedDict[StructuredSpec, object] = OrderedDict()
        self._compiling: dict[StructuredSpec, Future] = {}
        self._lock = threading.Lock()  # the cache is written on the compile threads
        self._build_lock = threading.Lock()  # the compiler is built once, on the first compile's thread
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiled = 0  # grammars compiled so far (cache misses)

    def _module(self):
        """xgrammar, or the RequestError of a missing package or tokenizer."""
        xgr = xgrammar()
        if self.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer (each token's bytes); this checkpoint has none")
        return xgr

    def _ready(self):
        """(xgrammar, the compiler over this vocabulary): built at the first compile, on its thread."""
        with self._build_lock:
            if self._compiler is None:
                xgr = self._module()
                info = xgr.TokenizerInfo(vocabulary(self.tokenizer, self.vocab_size), xgr.VocabType.RAW,
                                         vocab_size=self.vocab_size, stop_token_ids=list(self.eos_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, os.cpu_count() or 1)),
                                                     cache_enabled=False)
                self._xgr = xgr
        return self._xgr, self._compiler

    def prepare(self, spec: StructuredSpec) -> Future:
        """The spec's compiled grammar as a Future: done at once when cached, else compiling on
        the compiler's threads (``COMPILE_THREADS``), not the caller's. The spec is parsed here
        first, so a grammar that does not parse raises its RequestError now; one that fails to
        compile raises it from the Future."""
        xgr = self._module()
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                done: Future = Future()
                done.set_result(self._cache[spec])
                return done
            if spec in self._compiling:  # an equal spec is compiling: wait for the same one
                return self._compiling[spec]
        try:
            parsed = grammar_of(xgr, spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise _compile_error(spec, e) from None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="bi-grammar")
        with self._lock:
            future = self._compiling[spec] = self._pool.submit(self._compile, spec, parsed)
        return future

    def _compile(self, spec: StructuredSpec, parsed):
        try:
            out = self._ready()[1].compile_grammar(parsed)
        except (RuntimeError, ValueError, TypeError) as e:
            with self._lock:
                self._compiling.pop(spec, None)
            raise _compile_error(spec, e) from None
        with self._lock:  # cached before it stops compiling: an equal spec finds one or the other
            self.num_compiled += 1
            self._cache[spec] = out
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            self._compiling.pop(spec, None)
        return out

    def compiled(self, spec: StructuredSpec):
        """The spec's compiled grammar (waiting for its compile), from the cache when an equal
        spec was compiled before."""
        return self.prepare(spec).result()

    def state(self, spec: StructuredSpec, stop_ids: Seq[int] = ()) -> GrammarState:
        """A new sequence's grammar state; ``stop_ids``: its stop tokens besides EOS, which the
        grammar allows (as EOS) only where it may end."""
        compiled = self.compiled(spec)
        stops = tuple(dict.fromkeys(t for t in (*self.eos_ids, *stop_ids) if 0 <= t < self.vocab_size))
        return GrammarState(self._xgr, compiled, stops, self.vocab_size)


class GrammarState:
    """One sequence's grammar matcher, a function of the sequence's output tokens alone."""

    def __init__(self, xgr, compiled, stop_ids: tuple[int, ...], vocab_size: int) -> None:
        self._xgr, self._compiled, self.stop_ids, self.vocab_size = xgr, compiled, stop_ids, vocab_size
        self._matcher = None
        self._ids: list[int] = []  # the tokens its matcher accepted, in order
        self.rejected: int | None = None  # an output token the grammar refused (an engine bug), if any
        # the last verify row's (base key, drafts, matcher copy after them or None, mask)
        self._draft: tuple | None = None

    def _new_matcher(self):
        return self._xgr.GrammarMatcher(self._compiled, override_stop_tokens=list(self.stop_ids) or None)

    def _synced(self, output_ids: Seq[int]):
        """The matcher after ``output_ids`` (replayed from the start if they are not the tokens it saw)."""
        n = len(self._ids)
        if self._matcher is None or n > len(output_ids) or (n and output_ids[n - 1] != self._ids[-1]):
            self._matcher, self._ids, self.rejected = self._new_matcher(), [], None
            n = 0
        for t in output_ids[n:]:
            if self.rejected is None and not self._matcher.accept_token(t):
                self.rejected = t
            self._ids.append(t)
        return self._matcher

    def ended_by(self, output_ids: Seq[int]) -> bool:
        """Whether the last of ``output_ids`` ended the grammar (a stop token where it may end)."""
        return self._synced(output_ids).is_terminated() and self.rejected is None

    def mask(self, output_ids: Seq[int], before: Seq[int] = ()) -> torch.Tensor:
        """The allowed next tokens after ``output_ids`` then ``before`` (an MTP verify row's drafts
        before it), as an int32 bitmask ``[ceil(V / 32)]`` (bit t % 32 of word t // 32: token t).
        A row after a draft the grammar refuses gets a mask of an earlier state: its sample is
        never kept, since the row before it never draws the refused draft."""
        base = self._synced(output_ids)
        if not before:
            return self._fill(base)
        key, drafts = (id(base), len(self._ids)), tuple(before)
        d = self._draft
        if d is not None and d[0] == key and d[1] == drafts[:-1]:  # the next verify row of the same sequence
            copy, last = d[2], d[3]
            todo = drafts[-1:]
        else:
            copy, last, todo = base.fork(), None, drafts
        for t in todo:
            if copy is None or copy.is_terminated() or not copy.accept_token(t):
                copy = None  # refused: later rows keep the last mask
                break
        mask = self._fill(copy) if copy is not None else (last if last is not None else self._fill(base))
        self._draft = (key, drafts, copy, mask)
        return mask

    def _fill(self, matcher, out: torch.Tensor | None = None, row: int = 0) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        if out is None:
            out = torch.empty((1, words), dtype=torch.int32)
        if matcher.is_terminated():  # nothing follows; allow the stop tokens (the row is never kept)
            out[row] = 0
            for t in self.stop_ids:
                out[row, t // 32] |= _bit(t % 32)
        else:
            matcher.fill_next_token_bitmask(out, index=row)
        return out[row]


_BATCH: dict[int, object] = {}  # a BatchGrammarMatcher per xgrammar module (its thread pool)


def fill_rows(rows: Seq[tuple[GrammarState, Seq[int]]], out: torch.Tensor, threads: int = 0) -> None:
    """Row k of the host int32 buffer ``out`` := ``rows[k]``'s state's mask after its output ids
    (``GrammarState.mask``), the live matchers' rows filled together on xgrammar's threads
    (``BatchGrammarMatcher``: each row's bits are its own matcher's, whatever fills the others)."""
    if not rows:
        return
    live, at = [], []
    for k, (state, ids) in enumerate(rows):
        matcher = state._synced(ids)
        if matcher.is_terminated():
            state._fill(matcher, out, k)
        else:
            live.append(matcher)
            at.append(k)
    if not live:
        return
    xgr = rows[0][0]._xgr
    batch = _BATCH.get(id(xgr))
    if batch is None:
        batch = _BATCH[id(xgr)] = xgr.BatchGrammarMatcher(threads or max(1, min(8, (os.cpu_count() or 2) // 2)))
    batch.batch_fill_next_token_bitmask(live, out, at)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word as a Python int in int32's range (bit 31 is the sign)."""
    return -(1 << 31) if i == 31 else 1 << i
