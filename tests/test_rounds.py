"""benchmarks/rounds.py, the comparison benchmarks' rounds: the order systems run in, the median-and-range
cells, ratios computed round by round, and the "at parity" verdict where two systems' ranges overlap."""

import pytest

from benchmarks import rounds


def test_every_system_runs_once_a_round_and_none_always_first():
    order = rounds.interleave(["a", "b"], 4)
    assert order == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (3, "b"), (3, "a")]
    three = rounds.interleave(["a", "b", "c"], 3)
    by_round = [[name for r, name in three if r == k] for k in range(3)]
    assert by_round == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {names[0] for names in by_round} == {"a", "b", "c"}
    with pytest.raises(ValueError):
        rounds.interleave(["a"], 0)


def test_a_cell_is_the_median_with_its_range():
    assert rounds.cell([216.4, 190.2, 231.0]) == "216 (190-231)"
    assert rounds.cell([5.0, 7.0, 6.0], 1) == "6.0 (5.0-7.0)"
    assert rounds.cell([1234.5, 1500.0, 1100.0]) == "1,234 (1,100-1,500)"
    assert rounds.cell([42.0]) == "42.0"  # one round: no range to give
    s = rounds.Spread.of([3.0, 1.0, 2.0, None])
    assert (s.median, s.low, s.high) == (2.0, 1.0, 3.0) and s.holds(1.0) and not s.holds(3.5)


def test_the_ratio_is_taken_round_by_round_so_a_slow_round_hits_both():
    fast, slow = [100.0, 50.0, 102.0], [80.0, 40.0, 85.0]  # round 2 slow for both: its ratio is still 1.25
    assert rounds.ratios(fast, slow) == [1.25, 1.25, 1.2]
    assert rounds.ratio_cell(fast, slow) == "1.25x (1.20-1.25), at parity"  # ranges overlap: 50-102 and 40-85
    assert rounds.ratio_cell([118.0, 131.0, 102.0], [100.0] * 3) == "1.18x (1.02-1.31), ahead"
    assert rounds.ratio_cell([118.0, 131.0, 102.0], [100.0] * 3, word=False) == "1.18x (1.02-1.31)"
    with pytest.raises(ValueError, match="same rounds"):
        rounds.ratios([1.0, 2.0], [1.0])


def test_the_verdict_is_parity_where_the_ranges_overlap():
    assert rounds.verdict([10, 12, 11], [11.5, 13, 14]) == "at parity"
    assert rounds.verdict([10, 12, 11], [13, 14, 15]) == "behind"
    assert rounds.verdict([13, 14, 15], [10, 12, 11]) == "ahead"
    assert rounds.verdict([13, 14, 15], [10, 12, 11], higher_is_better=False) == "behind"  # e.g. ms/step
    assert rounds.verdict([12, 13], [10, 12]) == "at parity"  # touching ranges: within each other's noise


def test_a_sustained_rate_is_all_the_work_over_all_the_time():
    """Runs of the same work repeated until the least time has passed: their rate together is the harmonic mean
    of their rates (two runs of 100 tokens at 100 and 50 tokens/s: 200 tokens in 3 s), at least one run."""
    rates = iter([100.0, 50.0, 25.0])
    assert rounds.sustained(lambda: next(rates), min_seconds=0) == 100.0  # one run when no time is asked
    rates, clock = iter([100.0, 50.0, 25.0]), iter([0.0, 1.0, 3.0, 7.0])  # the clock after each run
    assert rounds.sustained(lambda: next(rates), min_seconds=2.5, clock=lambda: next(clock)) == pytest.approx(200 / 3)
    assert next(rates) == 25.0  # the third run was not needed: 3 s had passed
