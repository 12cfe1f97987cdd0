"""Comparisons that hold on another machine: systems run interleaved over rounds, each cell printed as the
median with its range over the rounds, each ratio likewise (computed round by round, so that a slow round
slows both sides of its own ratio), and "at parity" where two systems' ranges overlap. A module of the
benchmarks (serve_load.py, serve_chat.py, cpu_decode.py, train_threads.py, time_to_loss.py, reproduce.py and
bench.py's decoders against nanoGPT's), not a script: nothing here runs on its own.

    order = interleave(["gptkit", "llama.cpp"], 3)    # round 1: A B, round 2: B A, round 3: A B
    cell(rates["gptkit"])                             # '216 (190-231)'
    ratio_cell(rates["gptkit"], rates["llama.cpp"])   # '1.18x (1.02-1.31), at parity'
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_ROUNDS = 3
MIN_SECONDS = 10.0  # a cell's least work, in seconds of it (--min_seconds)
QUICK_SECONDS = 2.0  # benchmarks/reproduce.py --quick's


def rotation(items: Sequence, r: int) -> list:
    """Round r's order of items: rotated by r (A B C, B C A, C A B, ...; for two: alternating)."""
    items = list(items)
    return items[r % len(items):] + items[:r % len(items)] if items else []


def interleave(names: Sequence, rounds: int) -> list[tuple[int, object]]:
    """(round, name) in the order to run them: every system once per round, the order rotated by one each round
    (rotation()), so that no system always runs first, right after a start-up or another system's heaviest
    level."""
    if rounds < 1 or not names:
        raise ValueError("interleave needs at least one system and one round")
    return [(r, name) for r in range(rounds) for name in rotation(names, r)]


@dataclass(frozen=True)
class Spread:
    """A median and the lowest and highest value of the rounds."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        values = [v for v in values if v is not None]
        if not values:
            raise ValueError("no values to summarise")
        return cls(statistics.median(values), min(values), max(values))

    def overlaps(self, other: Spread) -> bool:
        return self.low <= other.high and other.low <= self.high

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high


def number(x: float, digits: int | None = None) -> str:
    """x with digits after the point; None: by size (3 significant figures, thousands separated)."""
    if digits is None:
        digits = 0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2
    return f"{x:,.{digits}f}"


def cell(values: Sequence[float], digits: int | None = None, unit: str = "") -> str:
    """'median (low-high)' of the rounds' values; one value alone: itself (no range to give)."""
    s = Spread.of(values)
    if len(values) == 1 or s.low == s.high:
        return f"{number(s.median, digits)}{unit}"
    return f"{number(s.median, digits)}{unit} ({number(s.low, digits)}-{number(s.high, digits)})"


def ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Each round's a / b: the rounds must pair up (the same rounds, in the same order)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} rounds against {len(b)}: a ratio needs the same rounds of both")
    return [x / y for x, y in zip(a, b) if x is not None and y]


def verdict(a: Sequence[float], b: Sequence[float], higher_is_better: bool = True) -> str:
    """'at parity' where the two systems' ranges over the rounds overlap (within each other's noise), else
    'ahead' or 'behind' (a's side of it)."""
    sa, sb = Spread.of(a), Spread.of(b)
    if sa.overlaps(sb):
        return "at parity"
    return "ahead" if (sa.median > sb.median) == higher_is_better else "behind"


def ratio_cell(a: Sequence[float], b: Sequence[float], higher_is_better: bool = True, word: bool = True) -> str:
    """a's rounds over b's as 'median x (low-high)' of the per-round ratios, and with word the verdict:
    e.g. '1.18x (1.02-1.31), at parity'."""
    s = Spread.of(ratios(a, b))
    text = f"{s.median:.2f}x" if len(a) == 1 or s.low == s.high else f"{s.median:.2f}x ({s.low:.2f}-{s.high:.2f})"
    return f"{text}, {verdict(a, b, higher_is_better)}" if word and len(a) > 1 else text


def sustained(rate: Callable[[], float], min_seconds: float = MIN_SECONDS,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """rate() (one run's work per second, e.g. tokens/s of a decode of a fixed number of tokens) run again
    until min_seconds of wall time have passed, at least once: the rate of all that work together (the
    harmonic mean of the runs' rates: each run did the same work)."""
    rates, start = [], clock()
    while not rates or clock() - start < min_seconds:
        rates.append(rate())
    return len(rates) / sum(1 / r for r in rates)
