"""The pruned draft vocabulary (FR-Spec): MTP drafts choose among the most frequent token ids only.

A draft needs no exactness (verification decides, bitwise), so the head's lm_head can skip most
of the vocabulary: on Qwen3.5 its 248,320 rows are the largest read of a draft step. A draft
outside the table is simply never proposed; the token the verify step samples is unchanged.

The table comes from a file (``strategy.draft_vocab``: token ids, most frequent first, counted on
your own traffic as FR-Spec counts a corpus; ``bi-engine draft-vocab`` writes one), or, without
one, is the lowest ids: in a byte-level BPE vocabulary such as Qwen's these are the bytes and the
earliest (most frequent) merges. The end-of-sequence ids are always in it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bi_core.errors import ConfigError


def draft_table(size: int, vocab_size: int, eos_ids: tuple[int, ...], path: str | None = None) -> list[int]:
    """``size`` distinct token ids (the end-of-sequence ids among them), in table order."""
    if size > vocab_size:
        raise ConfigError("strategy.draft_vocab_size", f"{size} exceeds the model's vocabulary ({vocab_size} ids)")
    ranked = read_table(path, vocab_size) if path is not None else list(range(vocab_size))
    eos = [t for t in dict.fromkeys(eos_ids) if 0 <= t < vocab_size]
    if size < len(eos) + 1:
        raise ConfigError("strategy.draft_vocab_size", f"{size} leaves no room beside the {len(eos)} "
                          "end-of-sequence id(s), which are always in the table")
    table = list(dict.fromkeys([*eos, *ranked]))[:size]
    if len(table) < size:
        raise ConfigError("strategy.draft_vocab", f"{path} has {len(table) - len(eos)} distinct ids (with the "
                          f"end-of-sequence ids, {len(table)}); strategy.draft_vocab_size asks for {size}")
    return table


def read_table(path: str, vocab_size: int) -> list[int]:
    """A table file: a JSON list of ints, or ints separated by whitespace."""
    expected = "expected token ids (a JSON list of ints, or ints separated by whitespace, e.g. what " \
               "bi-engine draft-vocab writes)"
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError("strategy.draft_vocab", f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("strategy.draft_vocab", f"{path} is not a text file (byte 0x{raw[e.start]:02x} at "
                          f"offset {e.start}); {expected}") from None
    ids = _parse_ids(text, path, expected)
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise ConfigError("strategy.draft_vocab", f"{path}: ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def _parse_ids(text: str, path: str, expected: str) -> list:
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError("strategy.draft_vocab", f"{path}: not a JSON list ({e.msg} at line {e.lineno}, "
                              f"column {e.colno}); {expected}") from None
    ids = []
    for n, item in enumerate(text.split(), 1):
        try:
            ids.append(int(item))
        except ValueError:
            raise ConfigError("strategy.draft_vocab", f"{path}: item {n} is {item[:40]!r}, not an int; "
                              f"{expected}") from None
    return ids


def count_table(tokenizer, texts, size: int | None = None) -> list[int]:
    """Token ids by frequency in ``texts`` (most frequent first; ties by id), at most ``size``."""
    counts: dict[int, int] = {}
    for text in texts:
        for t in tokenizer.encode(text):
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    return ranked[:size] if size is not None else ranked


def as_tensor(table: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.int64, device=device)
