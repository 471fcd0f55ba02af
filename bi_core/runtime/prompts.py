"""Prompts as users pass them (text, or token ids of Python, numpy or torch integers; one prompt
or a list of them) turned into lists of Python ints, with one clear error for anything else."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from bi_core.errors import RequestError

Prompt = str | Seq[int]


def is_token_id(t) -> bool:
    """An integer of Python, numpy or torch (a 0-d tensor); not a bool."""
    if isinstance(t, bool) or str(getattr(t, "dtype", "")) in ("bool", "torch.bool"):
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


def as_ints(prompt, what: str) -> list[int]:
    """Token ids as Python ints; RequestError names what is not one."""
    ndim = getattr(prompt, "ndim", None)
    if ndim is not None:  # a numpy array or torch tensor: converted in one call
        if ndim != 1:
            raise RequestError(f"{what} must be a 1-D array of token ids, got {ndim} dimensions")
        ids = prompt.tolist()
    elif isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
        raise RequestError(f"{what} must be a str or a sequence of token ids, got {type(prompt).__name__}")
    else:
        ids = list(prompt)
    if all(type(t) is int for t in ids):  # the common case, checked at C speed (a bool's type is bool)
        return ids
    bad = [t for t in ids if not is_token_id(t)]
    if bad:
        raise RequestError(f"{what} has token ids that are not integers: {bad[:5]!r}")
    return [operator.index(t) for t in ids]


def is_one_prompt(prompts) -> bool:
    """A lone str, or a flat sequence of token ids (whose first element is an integer); anything
    that is no sequence of prompts is one (bad) prompt, which its result names."""
    if isinstance(prompts, str) or getattr(prompts, "ndim", 2) < 2 or not isinstance(prompts, Iterable):
        return True
    return isinstance(prompts, Seq) and len(prompts) > 0 and is_token_id(prompts[0])


def ids_or_empty(prompt) -> list[int]:
    """A refused prompt's ids for its error result, where it has valid ones."""
    try:
        return [] if isinstance(prompt, str) else as_ints(prompt, "prompt")
    except RequestError:
        return []
