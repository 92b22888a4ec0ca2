"""Durations counted in a log-spaced histogram: how long the training thread waited for
its batches (raypipe.loader.stats), how long a fetch from object storage took
(raypipe.io.cache).

Invariant: a quantile is the upper edge of the bin that holds it, so it is within one
bin (19% at BINS_PER_OCTAVE 4) above the true value, never below it; the max, the count
and the sum are exact; the memory is BINS counters however many durations are added, and
histograms merge by adding their counts. Cost: one log2 and one increment an add (~1 us).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

BINS_PER_OCTAVE = 4
SMALLEST_SECONDS = 1e-6  # bin 0 holds everything up to a microsecond
BINS = 128  # up to ~4 x 10^3 s


@dataclass
class Durations:
    """A histogram of durations (see the module): `count` of them, their `total_seconds`
    and `max_seconds`."""

    counts: np.ndarray = field(default_factory=lambda: np.zeros(BINS, dtype=np.int64))
    count: int = 0
    max_seconds: float = 0.0
    total_seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_seconds += seconds
        self.max_seconds = max(self.max_seconds, seconds)
        self.counts[bin_of(seconds)] += 1

    def quantile(self, q: float) -> float:
        """Seconds: the upper edge of the bin holding the q-quantile, at most the max (0
        with none counted)."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        index = int(np.searchsorted(np.cumsum(self.counts), rank))
        return min(upper_edge(index), self.max_seconds)

    @classmethod
    def merged(cls, parts: Iterable[Durations]) -> Durations:
        """One histogram of every duration in `parts`."""
        whole = cls()
        for part in parts:
            whole.counts += part.counts
            whole.count += part.count
            whole.total_seconds += part.total_seconds
            whole.max_seconds = max(whole.max_seconds, part.max_seconds)
        return whole


def bin_of(seconds: float) -> int:
    if seconds <= SMALLEST_SECONDS:
        return 0
    index = math.ceil(math.log2(seconds / SMALLEST_SECONDS) * BINS_PER_OCTAVE)
    return min(max(index, 0), BINS - 1)


def upper_edge(index: int) -> float:
    return SMALLEST_SECONDS * 2 ** (index / BINS_PER_OCTAVE)
