"""MTP's accept rule on hand-built lists: the longest prefix of drafts equal to the tokens the
verify step sampled at the same positions (the sample after it is emitted too, by the caller)."""

from __future__ import annotations

import pytest
import torch

from bi_core.strategies.mtp import accepted_drafts, accepted_on_device


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


def test_the_device_rule_is_the_host_rule():
    """``accepted_on_device`` (the count a draft chain launched behind its verify starts from)
    gives ``accepted_drafts`` row by row, on hand-built rows and on random ones."""
    rows = [([1, 2, 3], [1, 2, 3, 4]), ([1, 2, 3], [9, 2, 3, 4]), ([1, 2, 3], [1, 9, 3, 4]),
            ([1, 2, 3], [1, 2, 9, 4]), ([7, 7, 7], [7, 7, 8, 7]), ([0, 0, 0], [0, 5, 0, 0])]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        d = torch.randint(0, 3, (3,), generator=g).tolist()
        rows.append((d, torch.randint(0, 3, (4,), generator=g).tolist()))
    drafts = torch.tensor([d for d, _ in rows])
    sampled = torch.tensor([s[:-1] for _, s in rows])
    got = accepted_on_device(drafts, sampled).tolist()
    assert got == [accepted_drafts(d, s) for d, s in rows]
    assert sorted(set(got)) == [0, 1, 2, 3]
