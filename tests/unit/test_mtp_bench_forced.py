"""benchmarks/mtp_bench.py's forced drafts on the CPU: the cut's law, and the stratified draw
that puts the accepted fraction at its expectation."""

from __future__ import annotations

import pytest
from helpers import benchmark_module


@pytest.fixture(scope="module")
def bench():
    return benchmark_module("mtp_bench")


class _Seq:
    request_id = 0
    output_ids: list[int] = []


def _cuts(bench, rate: float, chains: int, n: int = 3, start: int = 0) -> list[int]:
    truth = {0: list(range(1000, 1000 + n))}
    override = bench.forced(truth, rate, start)
    cuts = []
    for _ in range(chains):
        drafts = override(_Seq, n)
        assert len(drafts) == n
        cut = next((j for j, (d, t) in enumerate(zip(drafts, truth[0])) if d != t), n)
        assert all(d != t for d, t in zip(drafts[cut:], truth[0][cut:]))  # wrong after the cut, every one
        cuts.append(cut)
    return cuts


@pytest.mark.parametrize("rate", [0.5, 0.8])
def test_the_cut_has_the_law_of_positions_right_until_the_first_wrong_one(bench, rate):
    """P(cut >= j) = rate^j for j = 1..N, over many chains."""
    cuts = _cuts(bench, rate, 4000)
    for j in (1, 2, 3):
        assert abs(sum(c >= j for c in cuts) / len(cuts) - rate**j) < 0.01


@pytest.mark.parametrize("start", [0, 1000, 2000, 3000])
def test_about_a_hundred_chains_accept_at_the_expectation(bench, start):
    """The stratified draw: 90 chains (four B=1 generates' worth) sit within 0.015 of the expected
    accepted fraction (0.651 at r=0.8, N=3), wherever the sequence starts. The seeded
    pseudo-random draw it replaced gave 0.59 at B=1, every session."""
    assert bench.expected_accepted(0.8, 3) == pytest.approx((0.8 + 0.64 + 0.512) / 3)
    cuts = _cuts(bench, 0.8, 90, start=start)
    assert abs(sum(cuts) / (3 * len(cuts)) - bench.expected_accepted(0.8, 3)) < 0.015
