"""What every loader that is a view of a run has: its rank and device, the training
thread's waits, what its caches fetched, its state and the documents it excludes.

Invariant: the run (a raypipe.sampling Run or MixtureRun) owns where training stands, its
steps, shapes and state; a view only reads them and reports each batch taken
(`_served`), so a view computes no step, epoch or position. Cost: one attribute read per
property; `stats` sums the caches' counters (O(datasets)).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

from raypipe.io.cache import CacheStats
from raypipe.io.records import TokenizerInfo
from raypipe.loader.batch import Batch
from raypipe.loader.exclusions import PendingExclusions
from raypipe.loader.mixing import Mixing
from raypipe.loader.node_facts import NodeFacts
from raypipe.loader.options import LoaderOptions
from raypipe.loader.prefetch import Prefetcher
from raypipe.loader.reads import READ_AHEAD_STEPS
from raypipe.loader.stats import (
    ADVICE_EVERY,
    FetchSizing,
    LoaderStats,
    WaitStats,
    WaitSummary,
    fetch_sizing,
    fetching_line,
    loader_stats,
    summed_cache_stats,
)
from raypipe.sampling.epochs import window_budget

logger = logging.getLogger("raypipe")


class RunView:
    """The shared half of TokenLoader and MixtureLoader; `run` and `exclusions` are set by
    the loader, `_datasets()` names the datasets it reads."""

    run: Any
    exclusions: PendingExclusions

    def _open_view(self, options: LoaderOptions, data: str) -> None:
        """Rank, world size, device and waits from `options`; the node facts its ranks plan
        with (`data`: what it reads, named if the nodes differ)."""
        self.options = options
        self.rank, self.world_size = options.rank_and_world()
        self.node = NodeFacts.agreed(options, self.rank, self.world_size, data)
        self.device = options.torch_device()
        self.state_name: str | None = None  # where adapters (raypipe.ray.train) keep its state
        self.waits = WaitStats(describe=self._fetching_now, advise=self._sizing_advice)
        # (time.monotonic, bytes its caches had fetched) at the first batch: the read rate
        self._read_mark: tuple[float, int] | None = None
        self._mixing_checked = False  # the mixing advice was looked for (once, rank 0)
        self._open_prefetchers: set[Prefetcher] = set()  # iterations not ended yet

    def _datasets(self) -> list[Any]:
        raise NotImplementedError

    # ----- where the run stands -----------------------------------------------------------
    @property
    def steps(self) -> int:
        """Global steps taken from the start of training."""
        return self.run.steps

    @property
    def seq_len(self) -> int:
        """T of the next step's rows (the schedule's, at its step)."""
        return self.run.seq_len

    @property
    def global_batch(self) -> int:
        """Observations consumed by the next global step (the schedule's, at its step)."""
        return self.run.global_batch

    @property
    def tokenizer(self) -> TokenizerInfo:
        """The tokenizer as this loader's format holds it (a mixture's: one for all)."""
        return self._datasets()[0].tokenizer

    # ----- what it cost -------------------------------------------------------------------
    @property
    def data_waits(self) -> WaitSummary:
        """How long the training thread waited for its batches (raypipe.loader.stats):
        p50, p99 and max after the first batch, their sum, and the first batch's;
        `.metrics()` for a report."""
        return self.waits.summary()

    @property
    def stats(self) -> LoaderStats:
        """Waits per batch, and what the node cache fetched (bytes, files, retries; a
        mixture's sources summed) and holds against its budget
        (raypipe.loader.stats.LoaderStats; `.metrics()`)."""
        return loader_stats(self.data_waits, self._caches(), self._fetch_sizing(),
                            self._mixings())

    @property
    def cache_stats(self) -> CacheStats | None:
        """Downloads, hits and evictions of this loader's shard caches (None when local)."""
        return summed_cache_stats(self._caches())

    def _fetch_sizing(self) -> FetchSizing | None:
        """Whether this rank's read-ahead hides its fetches (raypipe.loader.stats), from
        its first batch to its last; None for a local dataset, before the first batch, or
        where no dataset reads in blocks."""
        held = [dataset for dataset in self._datasets()
                if dataset.cache is not None and getattr(dataset, "hold_bytes", 0)]
        reading = self._reading()
        if reading is None or not held:
            return None
        rate, step_ms = reading
        return fetch_sizing(self._caches(), sum(dataset.hold_bytes for dataset in held), rate,
                            READ_AHEAD_STEPS * step_ms, self._index_bytes)

    def _reading(self) -> tuple[float, float] | None:
        """(bytes its caches fetched a second, milliseconds a batch) from its first batch to
        its last (None before the first batch, or with no cache)."""
        caches = self._caches()  # the mark counts them all
        if self._read_mark is None or not caches:
            return None
        began, fetched_before = self._read_mark
        seconds = max(self.waits.last_batch_at - began, 1e-3)  # to the last batch taken
        rate = (summed_cache_stats(caches).downloaded_bytes - fetched_before) / seconds
        return rate, 1000 * seconds / max(self.waits.batches, 1)

    def _mixings(self) -> tuple[Mixing, ...]:
        """How its windowed plans of blocks on object storage mix shards at the rate it
        reads (raypipe.loader.mixing; a mixture's sources at the rate all read together)."""
        reading = self._reading()
        if reading is None:
            return ()
        return tuple(Mixing(layout, reading[0]) for layout in self.run.window_layouts())

    @cached_property
    def _index_bytes(self) -> int:
        """The bytes of the index files the node cache keeps for this loader's datasets
        (every rank reads them all; no window holds them)."""
        return sum(window_budget(dataset).index_bytes for dataset in self._datasets()
                   if dataset.cache is not None)

    def _sizing_advice(self, waits: WaitSummary) -> str:
        """The sizing check's line (WaitStats): marks the read rate's start at the first
        batch, then `FetchSizing.advice`."""
        if self._read_mark is None:
            fetched = summed_cache_stats(self._caches())
            self._read_mark = (time.monotonic(), fetched.downloaded_bytes if fetched else 0)
            return ""
        self._advise_mixing(waits)
        sizing = self._fetch_sizing()
        return sizing.advice(waits) if sizing is not None else ""

    def _advise_mixing(self, waits: WaitSummary) -> None:
        """Once ADVICE_EVERY batches have set the read rate, rank 0 says where a smaller
        block_bytes would mix shards better at that rate (raypipe.loader.mixing)."""
        if self._mixing_checked or waits.batches < ADVICE_EVERY:
            return
        self._mixing_checked = True
        if self.rank != 0:
            return
        for mixing in self._mixings():
            line = mixing.advice()
            if line:
                logger.warning("%s", line)

    def _caches(self) -> list[Any]:
        return [dataset.cache for dataset in self._datasets() if dataset.cache is not None]

    def _fetching_now(self) -> str:
        """What the loader was doing while a batch was late (raypipe.loader.stats)."""
        return "; ".join(line for line in map(fetching_line, self._datasets()) if line)

    # ----- serving --------------------------------------------------------------------------
    def _served(self, prefetcher: Prefetcher, took: Callable[[Batch], None]
                ) -> Iterator[Batch]:
        """The prefetcher's batches, the run told of each as it is taken."""
        self._open_prefetchers.add(prefetcher)
        try:
            for batch in prefetcher:
                took(batch)
                yield batch
        finally:
            prefetcher.close()
            self._open_prefetchers.discard(prefetcher)

    def close(self) -> None:
        """Stop building batches ahead (an iteration still held open serves what was
        built, then raises) and background shard fetches, and close open shards
        (object storage), so nothing of this loader fetches, writes to or pins files in the
        node cache after it returns. Iterating again continues from the run's position."""
        prefetchers = list(self._open_prefetchers)
        for prefetcher in prefetchers:  # no batch is begun after the ones being built
            prefetcher.stop.set()
        for dataset in self._datasets():  # a build waiting on a queued fetch is let go
            dataset.cancel_queued_fetches()
        for prefetcher in prefetchers:
            prefetcher.close()
        self._open_prefetchers.clear()
        for dataset in self._datasets():
            dataset.close()

    # ----- state (the run's) --------------------------------------------------------------
    def knobs(self) -> dict[str, Any]:
        """The knobs that shape this loader's observations (its state records them)."""
        return self.run.knobs()

    def state_dict(self) -> dict[str, Any]:
        self._exclude()
        return self.run.state().to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state` (any rank's `state_dict()`, any world size); the documents
        of `exclude` that the state's exclusions do not hold are excluded from its step."""
        self.run.resume(state)
        self.exclusions.resumed()
        self._exclude()

    def _exclude(self) -> None:
        """Exclude the `exclude` option's documents from where the run stands, once (a
        mixture's run excludes them source by source)."""
        self.exclusions.apply(self.run.exclude)
