"""How long the training thread waits for its batches (raypipe.loader.stats): the histogram's
quantiles against exact ones, a slow producer against a slow consumer through the real
prefetch ring, and a TokenLoader's own figures; the sizing check that names the least
cache_bytes whose read-ahead hides the fetches from a bucket."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.io.cache import ShardCache
from raypipe.io.durations import BINS_PER_OCTAVE, Durations
from raypipe.loader import TokenLoader
from raypipe.loader import stats as stats_module
from raypipe.loader.prefetch import HostRing, Prefetcher
from raypipe.loader.stats import (
    ADVICE_EVERY,
    FETCHES_COVERED,
    WAIT_TARGET_MS,
    FetchSizing,
    WaitStats,
    WaitSummary,
    fetch_sizing,
)

BIN_RATIO = 2 ** (1 / BINS_PER_OCTAVE)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=2e-6, max_value=500.0), min_size=2, max_size=400),
       st.sampled_from([0.5, 0.9, 0.99]))
def test_a_quantile_is_the_true_one_within_one_bin_and_the_first_wait_is_apart(waits, q):
    stats = WaitStats()
    for seconds in waits:
        stats.add(seconds)
    rest = np.array(waits[1:])
    true = float(np.sort(rest)[max(1, int(np.ceil(q * rest.size))) - 1])
    got = stats.quantile(q)
    assert true <= got * (1 + 1e-9) and got <= true * BIN_RATIO * (1 + 1e-9)
    summary = stats.summary()
    assert summary.batches == rest.size and summary.first_batch_s == round(waits[0], 3)
    assert summary.max_ms == round(1000 * rest.max(), 3)
    assert abs(summary.total_s - rest.sum()) < 1e-3


def served(job_seconds: float, consumer_seconds: float, jobs: int = 12) -> WaitStats:
    """The real prefetch ring over `jobs` jobs that each take `job_seconds` to build, read
    by a consumer that spends `consumer_seconds` on each batch."""
    def slow_jobs():
        for index in range(jobs):
            time.sleep(job_seconds)
            yield index

    waits = WaitStats()
    ring = HostRing(4, 8, torch.int64, pin=False)
    prefetcher = Prefetcher(slow_jobs(), lambda job, slot: job,
                            lambda tensor, slot, meta: meta, ring, torch.device("cpu"),
                            depth=2, waits=waits)
    for _ in prefetcher:
        time.sleep(consumer_seconds)
    prefetcher.close()
    return waits


def test_a_slow_producer_shows_in_the_waits_and_a_slow_consumer_does_not():
    starved = served(job_seconds=0.03, consumer_seconds=0.0).summary()
    assert starved.batches == 11 and starved.p50_ms >= 20 and starved.total_s >= 0.25
    fed = served(job_seconds=0.0, consumer_seconds=0.03).summary()
    assert fed.batches == 11 and fed.p99_ms < 10 and fed.total_s < 0.05


def test_batches_built_before_a_job_that_waits_on_a_fetch_are_handed_over_first():
    """Batches go over 4 at a time, but job 2 waits on a fetch that only comes once the
    consumer has batch 1: without the hand-over before job 2, batch 1 waits behind it
    (here for ever: the 2 s timeout fails the test)."""
    fetched = threading.Event()

    def build(job: int, slot: int) -> int:
        if job == 2:
            assert fetched.wait(2.0), "batch 1 was held behind the build that waits"
        return job

    ring = HostRing(4 * 4 + 2, 8, torch.int64, pin=False)
    prefetcher = Prefetcher(iter(range(6)), build, lambda tensor, slot, meta: meta, ring,
                            torch.device("cpu"), depth=2, chunk=4,
                            ready=lambda job: job != 2 or fetched.is_set())
    taken = []
    for batch in prefetcher:
        taken.append(batch)
        if batch == 1:
            fetched.set()
    prefetcher.close()
    assert taken == list(range(6))


def test_a_wait_past_the_threshold_is_logged_once_a_minute_with_what_the_loader_did(
        monkeypatch, caplog):
    monkeypatch.setattr(stats_module, "SLOW_WAIT_SECONDS", 0.01)
    stats = WaitStats(describe=lambda: "2 shard(s) being fetched")
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        for seconds in (5.0, 0.5, 0.2, 0.001):  # the first is the cold start: not logged
            stats.add(seconds)
    lines = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(lines) == 1 and "0.50 s" in lines[0] and "2 shard(s) being fetched" in lines[0]


def test_a_token_loader_reports_its_waits_per_batch(token_dataset):
    loader = TokenLoader(token_dataset, 32, 4, seed=1)
    batches = sum(1 for _ in loader)
    summary = loader.data_waits
    assert summary.batches == batches - 1 and summary.first_batch_s >= 0
    assert 0 <= summary.p50_ms <= summary.p99_ms <= summary.max_ms
    metrics = summary.metrics()
    assert set(metrics) == {"data_wait_p50_ms", "data_wait_p99_ms", "data_wait_max_ms",
                            "data_wait_total_s", "data_wait_first_batch_s"}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.floats(min_value=0.0, max_value=60.0), max_size=50),
                min_size=1, max_size=4), st.sampled_from([0.5, 0.99]))
def test_histograms_merged_are_the_histogram_of_every_duration(parts, q):
    whole = Durations()
    for seconds in (value for part in parts for value in part):
        whole.add(seconds)
    separate = []
    for part in parts:
        histogram = Durations()
        for seconds in part:
            histogram.add(seconds)
        separate.append(histogram)
    merged = Durations.merged(separate)
    assert merged.count == whole.count and merged.max_seconds == whole.max_seconds
    assert merged.counts.tolist() == whole.counts.tolist()
    assert merged.quantile(q) == whole.quantile(q)


def waits_of(p99_ms: float) -> WaitSummary:
    return WaitSummary(1000, p99_ms / 2, p99_ms, p99_ms, 1.0, 0.5)


def test_a_read_ahead_shorter_than_two_fetches_with_late_batches_names_the_least_budget(
        tmp_path):
    """A rank holding 1 MB ahead that reads 10 MB/s holds 100 ms of reading; fetches of
    p99 ~80 ms need 2 x 80 ms: the budget past the index files grows by 1.6x."""
    cache = ShardCache(tmp_path, budget_bytes=5_000_000)
    for _ in range(99):
        cache.fetch_times.add(0.080)
    cache.fetch_times.add(0.010)
    sizing = fetch_sizing([cache], 1_000_000, 10e6, steps_ahead_ms=640.0,
                          index_bytes=1_000_000)
    assert 80 <= sizing.fetch_p99_ms <= 80 * 2 ** (1 / BINS_PER_OCTAVE)
    assert sizing.read_ahead_ms == sizing.hold_ms == 100 and sizing.budget_short
    # the least budget's read-ahead (the same share of what the index files leave)
    # holds two fetches' p99 of reading, and no more
    held_then = 1_000_000 * (sizing.least_budget_bytes - 1_000_000) / 4_000_000
    covered_ms = 1000 * held_then / 10e6
    assert FETCHES_COVERED * sizing.fetch_p99_ms <= covered_ms + 1e-3
    assert covered_ms <= FETCHES_COVERED * sizing.fetch_p99_ms * 1.001
    line = sizing.advice(waits_of(WAIT_TARGET_MS + 20))
    assert f"give cache_bytes >= {sizing.least_budget_bytes:,}" in line
    assert "holds 100 ms of this loop's reading (10.00 MB/s)" in line
    assert sizing.advice(waits_of(WAIT_TARGET_MS)) == ""  # waits within the target
    assert sizing.metrics()["least_cache_bytes"] == sizing.least_budget_bytes


def test_a_read_ahead_that_covers_its_fetches_gives_no_advice_however_late_the_batches():
    covered = FetchSizing(4_000_000, 10e6, 640.0, 40.0, 80.0, 8_000_000, 8_000_000)
    assert covered.read_ahead_ms == 400 and not covered.short
    assert covered.advice(waits_of(500)) == ""  # late for another reason than the budget
    idle = FetchSizing(1, 0.0, 640.0, 0.0, 0.0, 8_000_000, 8_000_000)  # nothing fetched
    assert not idle.short and idle.advice(waits_of(500)) == ""


def test_a_read_ahead_ended_by_its_steps_not_its_share_is_not_told_to_grow_the_cache():
    """64 steps of a fast loop span 64 ms, under two fetches of 80 ms, while the share of
    the cache holds 400 ms: a larger cache_bytes would not fetch further ahead."""
    fast = FetchSizing(4_000_000, 10e6, 64.0, 40.0, 80.0, 8_000_000, 8_000_000)
    assert fast.read_ahead_ms == 64 and fast.short and not fast.budget_short
    assert fast.advice(waits_of(500)) == ""


def test_the_sizing_check_runs_at_the_first_batch_then_every_few_and_warns_once(caplog):
    asked: list[int] = []

    def advise(waits: WaitSummary) -> str:
        asked.append(waits.batches)
        return "read-ahead short" if waits.batches >= 2 * ADVICE_EVERY else ""

    stats = WaitStats(advise=advise)
    with caplog.at_level(logging.WARNING, logger="raypipe"):
        for _ in range(4 * ADVICE_EVERY + 1):
            stats.add(0.001)
    assert asked == [0, ADVICE_EVERY, 2 * ADVICE_EVERY]
    lines = [r.getMessage() for r in caplog.records if "read-ahead short" in r.getMessage()]
    assert lines == ["read-ahead short (warned once)"]
