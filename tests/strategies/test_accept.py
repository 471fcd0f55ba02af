"""MTP's accept rule on hand-built lists: the longest prefix of drafts equal to the tokens the
verify step sampled at the same positions (the sample after it is emitted too, by the caller)."""

from __future__ import annotations

import pytest

from bi_core.strategies.mtp import accepted_drafts


@pytest.mark.parametrize(("drafts", "sampled", "accepted"), [
    ([], [5], 0),  # nothing to verify: only the pending token's sample
    ([1, 2, 3], [1, 2, 3, 4], 3),  # all accepted, plus the bonus sample
    ([1, 2, 3], [9, 2, 3, 4], 0),  # the first differs: none, even though later ones match
    ([1, 2, 3], [1, 9, 3, 4], 1),
    ([1, 2, 3], [1, 2, 9, 4], 2),
    ([7, 7], [7, 7, 7], 2),
])
def test_longest_equal_prefix(drafts, sampled, accepted):
    assert accepted_drafts(drafts, sampled) == accepted


def test_short_drafts_compare_only_what_was_proposed():
    """Drafts cut short (near max_new_tokens) are compared over their own length only; the
    verify step's padding rows are never sampled."""
    assert accepted_drafts([4], [4, 8]) == 1
