"""Command-line values shared by the CLI's commands: one error naming the flag, never a traceback."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import attrs

from bi_core.errors import BiEngineError, ConfigError


def positive_ints(text: str, flag: str) -> list[int]:
    """``"1,8,64"`` -> ``[1, 8, 64]``; anything else (empty, a non-integer, a value below 1) is
    one BiEngineError naming ``flag``."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise BiEngineError(f"{flag}: expected comma-separated positive integers, got {text!r}")
    return values


def token_ids(text: str, flag: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``: every item a non-negative integer; an empty item (``1,,2``, a
    trailing comma) is refused rather than dropped, since it is more likely a lost id than nothing."""
    items = str(text).split(",")
    for n, item in enumerate(items, 1):
        try:
            value = int(item)
        except ValueError:
            value = -1
        if value < 0:
            what = "empty" if not item.strip() else repr(item.strip())
            raise BiEngineError(f"{flag}: expected comma-separated integers >= 0 (token ids), got {text!r} "
                                f"(item {n} is {what})")
    return [int(item) for item in items]


def config_value(section: type, key: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` for a flag that overrides config key ``key`` of ``section``: the text
    converted with ``convert`` (int or float), then checked by that key's own parser, so a flag
    takes what the YAML takes (same range, finite numbers only) and its error names the flag."""
    parse = attrs.fields_dict(section)[key].metadata["parse"]
    kind = "an int" if convert is int else "a number"

    def check(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        try:
            return parse(value, key)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(e.reason) from None

    check.__name__ = key  # argparse names the type in some messages
    return check
