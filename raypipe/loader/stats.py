"""How long the training thread waited for its batches: the one figure that says whether
data loading stalls a run.

Invariant: every batch a loader yields adds one wait to its `WaitStats`: the time the
training thread was blocked taking it from the prefetch queue (a handoff of several
batches counts its wait on its first batch, 0 on the others), so the waits add up to
the time training stood still for data. The first batch (the cold start: opening shards,
planning the epoch) is kept apart. Waits are counted in a log-spaced histogram
(raypipe.io.durations: a quantile within 19% of the true value in 128 counters however
long the run). A wait past SLOW_WAIT_SECONDS is logged (at most once a minute) with what
the loader's cache was doing; where waits pass WAIT_TARGET_MS at p99 because a rank's
share of the cache holds less of its reading than its fetches take (`FetchSizing`), the
loader warns once, naming the least `cache_bytes` that covers them. Cost: three clock
reads and one histogram increment per batch (~1 us); the sizing check every ADVICE_EVERY
batches (O(datasets); its first also sums the index files' bytes, O(files), once).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from raypipe.io.cache import CacheStats
from raypipe.io.durations import Durations
from raypipe.loader.mixing import Mixing

logger = logging.getLogger("raypipe")

SLOW_WAIT_SECONDS = 1.0
SLOW_LOG_INTERVAL = 60.0
FETCHES_NAMED = 3  # shards a slow-wait line names
# the sizing check (FetchSizing): run at the first batch, then every ADVICE_EVERY batches
# until it has warned once; it warns where the waits' p99 passes WAIT_TARGET_MS and a
# rank's read-ahead covers less than FETCHES_COVERED fetches' p99 of its reading
ADVICE_EVERY = 256
WAIT_TARGET_MS = 50.0
FETCHES_COVERED = 2.0


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
class FetchSizing:
    """Whether a rank's read-ahead hides the fetches from object storage: what it holds
    and fetches ahead (`hold_bytes`, its share of the node cache's `budget_bytes`), what
    it fetched a second from its first batch to its last, the milliseconds the steps it
    describes ahead span at the loop's step time, the fetches' p50 and p99 (a file, or a
    run of a shard's blocks, retries included), and the least budget whose share holds
    FETCHES_COVERED x that p99 of its reading."""

    hold_bytes: int
    read_bytes_per_s: float
    steps_ahead_ms: float
    fetch_p50_ms: float
    fetch_p99_ms: float
    budget_bytes: int
    least_budget_bytes: int

    @property
    def hold_ms(self) -> float:
        """The milliseconds of this loop's reading a rank's share of the cache holds."""
        if self.read_bytes_per_s <= 0:
            return math.inf
        return 1000 * self.hold_bytes / self.read_bytes_per_s

    @property
    def read_ahead_ms(self) -> float:
        """How far ahead a rank fetches: its share of the cache, or the steps it
        describes ahead, whichever ends first."""
        return min(self.hold_ms, self.steps_ahead_ms)

    @property
    def short(self) -> bool:
        """The read-ahead covers less than FETCHES_COVERED fetches' p99: a block a rank
        needs can still be on its way when its step comes."""
        return self.read_ahead_ms < FETCHES_COVERED * self.fetch_p99_ms

    @property
    def budget_short(self) -> bool:
        """`short`, and its share of the cache is what ends the read-ahead (a larger
        `cache_bytes` fetches further ahead)."""
        return self.short and self.hold_ms <= self.steps_ahead_ms

    def metrics(self) -> dict[str, float]:
        return {"fetch_p50_ms": self.fetch_p50_ms, "fetch_p99_ms": self.fetch_p99_ms,
                "read_ahead_ms": round(min(self.read_ahead_ms, 1e9), 1),
                "least_cache_bytes": self.least_budget_bytes}

    def advice(self, waits: WaitSummary) -> str:
        """A line for a run whose waits pass WAIT_TARGET_MS at p99 because its share of
        the cache holds too little of its reading (`budget_short`; "" otherwise)."""
        if waits.p99_ms <= WAIT_TARGET_MS or not self.budget_short:
            return ""
        return (f"the training thread waited p99 {waits.p99_ms:.0f} ms for its batches: "
                f"a rank's read-ahead ({self.hold_bytes:,} bytes of cache_bytes "
                f"{self.budget_bytes:,}) holds {self.hold_ms:.0f} ms of this loop's "
                f"reading ({self.read_bytes_per_s / 1e6:.2f} MB/s), less than "
                f"{FETCHES_COVERED:g}x the fetches' p99 from object storage "
                f"({self.fetch_p99_ms:.0f} ms); give cache_bytes >= "
                f"{self.least_budget_bytes:,} (the same on every node) to fetch far enough "
                "ahead")


@dataclass(frozen=True)
class LoaderStats:
    """What a loader's data cost: the training thread's waits, and (object storage) what
    the node cache fetched and holds: bytes and requests fetched, retries, and the budget
    in use (bytes in the cache's directory against its budget), and, under blocks,
    whether a rank's read-ahead hides the fetches (`FetchSizing`)."""

    waits: WaitSummary
    cache: Any = None  # raypipe.io.cache.CacheStats of this process (None: a local dataset)
    budget_bytes: int = 0
    used_bytes: int = 0
    sizing: FetchSizing | None = None
    mixing: tuple[Mixing, ...] = ()  # how each windowed plan of a bucket mixes shards

    def metrics(self) -> dict[str, float]:
        """Flat metrics for a report (Ray Train's `report`, a logger)."""
        metrics = self.waits.metrics()
        if self.cache is not None:
            metrics.update(fetched_bytes=self.cache.downloaded_bytes,
                           fetched_files=self.cache.downloads, fetch_retries=self.cache.retries,
                           cache_used_bytes=self.used_bytes,
                           cache_budget_bytes=self.budget_bytes)
        if self.sizing is not None:
            metrics.update(self.sizing.metrics())
        if self.mixing:  # the plan that mixes least
            metrics.update(max(self.mixing, key=lambda mix: mix.times_uniform).metrics())
        return metrics


@dataclass
class WaitStats:
    """The training thread's waits for its batches (see the module)."""

    describe: Callable[[], str] = lambda: ""  # what the loader was doing, for the slow log
    # the sizing check (FetchSizing.advice): a line to warn once, "" for none
    advise: Callable[[WaitSummary], str] = lambda waits: ""
    waits: Durations = field(default_factory=Durations)
    first_batch_seconds: float | None = None
    last_slow_log: float = -math.inf
    advised: bool = False
    last_batch_at: float = 0.0  # time.monotonic when the last batch was taken

    @property
    def batches(self) -> int:
        return self.waits.count

    def add(self, seconds: float) -> None:
        """One batch's wait."""
        self.last_batch_at = time.monotonic()
        if self.first_batch_seconds is None:
            self.first_batch_seconds = seconds
            self._check_sizing()
            return
        self.waits.add(seconds)
        if seconds > SLOW_WAIT_SECONDS:
            self._log_slow(seconds)
        if self.waits.count % ADVICE_EVERY == 0:
            self._check_sizing()

    def quantile(self, q: float) -> float:
        """Seconds: the upper edge of the bin holding the q-quantile (0 with no batch)."""
        return self.waits.quantile(q)

    def summary(self) -> WaitSummary:
        return WaitSummary(self.batches, round(1000 * self.quantile(0.5), 3),
                           round(1000 * self.quantile(0.99), 3),
                           round(1000 * self.waits.max_seconds, 3),
                           round(self.waits.total_seconds, 3),
                           round(self.first_batch_seconds or 0.0, 3))

    def _check_sizing(self) -> None:
        if self.advised:
            return
        line = self.advise(self.summary())
        if line:
            self.advised = True
            logger.warning("%s (warned once)", line)

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


def loader_stats(waits: WaitSummary, caches: Sequence[Any],
                 sizing: FetchSizing | None = None, mixing: tuple[Mixing, ...] = ()
                 ) -> LoaderStats:
    """A loader's LoaderStats: its waits and what its datasets' caches fetched, against
    the (one, shared) node cache's budget, its `sizing` and `mixing`."""
    fetched = summed_cache_stats(caches)
    if fetched is None:
        return LoaderStats(waits)
    return LoaderStats(waits, fetched, caches[0].budget_bytes, caches[0].used_bytes(),
                       sizing, mixing)


def fetch_sizing(caches: Sequence[Any], hold_bytes: int, read_bytes_per_s: float,
                 steps_ahead_ms: float, index_bytes: int) -> FetchSizing:
    """The FetchSizing of a rank that holds and fetches ahead `hold_bytes` from `caches`
    (the node cache's budget less `index_bytes` of index files is shared by every
    reader in proportion: a budget k times larger past the index holds k times as much),
    reads `read_bytes_per_s` and describes steps `steps_ahead_ms` ahead."""
    times = Durations.merged(cache.fetch_times for cache in caches)
    budget = caches[0].budget_bytes
    p99 = times.quantile(0.99)
    needed = FETCHES_COVERED * p99 * read_bytes_per_s
    least = index_bytes + math.ceil(max(budget - index_bytes, 0)
                                    * max(needed / max(hold_bytes, 1), 1.0))
    return FetchSizing(hold_bytes, read_bytes_per_s, steps_ahead_ms,
                       round(1000 * times.quantile(0.5), 3), round(1000 * p99, 3), budget,
                       least)


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
