"""Command-line values shared by the CLI's commands: one error naming the flag, never a traceback."""

from __future__ import annotations

from bi_core.errors import BiEngineError


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
