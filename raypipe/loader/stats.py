"""How long the training thread waited for its batches: the one figure that says whether
data loading stalls a run.

Invariant: every batch a loader yields adds one wait to its `WaitStats`: the time the
training thread was blocked taking it from the prefetch queue (a handoff of several
batches counts its wait on its first batch, 0 on the others), so the waits add up to
the time training stood still for data. The first batch (the cold start: opening shards,
planning the epoch) is kept apart. Waits are counted in a log-spaced histogram (4 bins an
octave, 64 bins from a microsecond up), so a quantile is within 19% of the true value and the
memory is fixed (64 counters) however long the run. A wait past SLOW_WAIT_SECONDS is
logged (at most once a minute) with what the loader's cache was doing. Cost: two clock
reads and one histogram increment per batch (~1 us).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from raypipe.io.cache import CacheStats

logger = logging.getLogger("raypipe")

BINS_PER_OCTAVE = 4
SMALLEST_SECONDS = 1e-6
BINS = 128
SLOW_WAIT_SECONDS = 1.0
SLOW_LOG_INTERVAL = 60.0
FETCHES_NAMED = 3  # shards a slow-wait line names


@dataclass(frozen=True)
class WaitSummary:
    """The waits of the batches after the first: their count, quantiles and worst (in
    ms, each a histogram bin's upper edge, except the max), their sum, and the first
    batch's wait."""

    batches: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    total_s: float
    first_batch_s: float

    def metrics(self, prefix: str = "data_wait") -> dict[str, float]:
        """Flat metrics for a report (Ray Train's `report`, a logger)."""
        return {f"{prefix}_p50_ms": self.p50_ms, f"{prefix}_p99_ms": self.p99_ms,
                f"{prefix}_max_ms": self.max_ms, f"{prefix}_total_s": self.total_s,
                f"{prefix}_first_batch_s": self.first_batch_s}


@dataclass(frozen=True)
class LoaderStats:
    """What a loader's data cost: the training thread's waits, and (object storage) what
    the node cache fetched and holds: bytes and requests fetched, retries, and the budget
    in use (bytes in the cache's directory against its budget)."""

    waits: WaitSummary
    cache: Any = None  # raypipe.io.cache.CacheStats of this process (None: a local dataset)
    budget_bytes: int = 0
    used_bytes: int = 0

    def metrics(self) -> dict[str, float]:
        """Flat metrics for a report (Ray Train's `report`, a logger)."""
        metrics = self.waits.metrics()
        if self.cache is not None:
            metrics.update(fetched_bytes=self.cache.downloaded_bytes,
                           fetched_files=self.cache.downloads, fetch_retries=self.cache.retries,
                           cache_used_bytes=self.used_bytes,
                           cache_budget_bytes=self.budget_bytes)
        return metrics


@dataclass
class WaitStats:
    """The training thread's waits for its batches (see the module)."""

    describe: Callable[[], str] = lambda: ""  # what the loader was doing, for the slow log
    counts: np.ndarray = field(default_factory=lambda: np.zeros(BINS, dtype=np.int64))
    batches: int = 0
    max_seconds: float = 0.0
    total_seconds: float = 0.0
    first_batch_seconds: float | None = None
    last_slow_log: float = -math.inf

    def add(self, seconds: float) -> None:
        """One batch's wait."""
        if self.first_batch_seconds is None:
            self.first_batch_seconds = seconds
            return
        self.batches += 1
        self.total_seconds += seconds
        self.max_seconds = max(self.max_seconds, seconds)
        self.counts[self.bin_of(seconds)] += 1
        if seconds > SLOW_WAIT_SECONDS:
            self._log_slow(seconds)

    @staticmethod
    def bin_of(seconds: float) -> int:
        if seconds <= SMALLEST_SECONDS:
            return 0
        index = math.ceil(math.log2(seconds / SMALLEST_SECONDS) * BINS_PER_OCTAVE)
        return min(max(index, 0), BINS - 1)

    @staticmethod
    def upper_edge(index: int) -> float:
        return SMALLEST_SECONDS * 2 ** (index / BINS_PER_OCTAVE)

    def quantile(self, q: float) -> float:
        """Seconds: the upper edge of the bin holding the q-quantile (0 with no batch)."""
        if not self.batches:
            return 0.0
        rank = max(1, math.ceil(q * self.batches))
        index = int(np.searchsorted(np.cumsum(self.counts), rank))
        return min(self.upper_edge(index), self.max_seconds)

    def summary(self) -> WaitSummary:
        return WaitSummary(self.batches, round(1000 * self.quantile(0.5), 3),
                           round(1000 * self.quantile(0.99), 3),
                           round(1000 * self.max_seconds, 3), round(self.total_seconds, 3),
                           round(self.first_batch_seconds or 0.0, 3))

    def _log_slow(self, seconds: float) -> None:
        now = time.monotonic()
        if now - self.last_slow_log < SLOW_LOG_INTERVAL:
            return
        self.last_slow_log = now
        doing = self.describe()
        logger.warning("the training thread waited %.2f s for its next batch (more than "
                       "%.1f s; logged at most once a minute)%s", seconds, SLOW_WAIT_SECONDS,
                       f": {doing}" if doing else "")


def summed_cache_stats(caches: Sequence[Any]) -> CacheStats | None:
    """What the node caches of a loader's datasets fetched, summed (None: all local)."""
    if not caches:
        return None
    return CacheStats(*(sum(getattr(cache.stats, item.name) for cache in caches)
                        for item in fields(CacheStats)))


def loader_stats(waits: WaitSummary, caches: Sequence[Any]) -> LoaderStats:
    """A loader's LoaderStats: its waits and what its datasets' caches fetched, against
    the (one, shared) node cache's budget."""
    fetched = summed_cache_stats(caches)
    if fetched is None:
        return LoaderStats(waits)
    return LoaderStats(waits, fetched, caches[0].budget_bytes, caches[0].used_bytes())


def fetching_line(dataset: Any) -> str:
    """What a loader was doing while a batch was late: the shards of `dataset` on their
    way from object storage, by name, and its cache's counts ("" for a local dataset)."""
    cache = dataset.cache
    if cache is None:
        return ""
    stats, names = cache.stats, dataset.fetching_now()
    shown = ", ".join(names[:FETCHES_NAMED]) + (f" and {len(names) - FETCHES_NAMED} more"
                                                if len(names) > FETCHES_NAMED else "")
    return (f"waiting on {shown or 'no shard'} of {dataset.root} (the first: the one the "
            f"next batch opens, if any); cache so far: {stats.downloads} downloads, "
            f"{stats.downloaded_bytes:,} bytes, {stats.retries} retries, "
            f"{stats.evicted_files} evictions, budget {cache.budget_bytes:,}")
