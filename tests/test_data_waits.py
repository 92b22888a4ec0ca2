"""How long the training thread waits for its batches (raypipe.loader.stats): the histogram's
quantiles against exact ones, a slow producer against a slow consumer through the real
prefetch ring, and a TokenLoader's own figures."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.loader import TokenLoader
from raypipe.loader import stats as stats_module
from raypipe.loader.prefetch import HostRing, Prefetcher
from raypipe.loader.stats import BINS_PER_OCTAVE, WaitStats

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
