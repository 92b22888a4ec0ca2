"""MixtureLoader: batches drawn from several tokenized datasets at fixed weights, with a state
that resumes exactly, at any world size.

Invariant: the loader is a view of one `MixtureRun` (raypipe.sampling.mixture_run), which owns the
sources' positions, the split of each global step between them (raypipe.sampling.mixture:
every source within one row of its weight after every step, a pure function of the rows each
has served, so every rank and every resume computes the same split), the steps and the
state. The loader keeps placement: each source's rows of this rank described and filled into
a scratch buffer of the source, then copied into the batch's rows (slot j of a step goes to
rank j mod W, as in TokenLoader), prefetch and tensors. Sources share one tokenizer (same
sha256) or the mixture is refused naming both. Cost per batch: one allocation
(O(sources)), one describe and fill per source present in the rank's rows, and one row copy
from a source's scratch buffer into the batch (bench/loader_bench.py --mixture measures it
against one source).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.errors import ConfigError
from raypipe.io.cache import CacheStats
from raypipe.loader.batch import Batch
from raypipe.loader.exclusions import PendingExclusions
from raypipe.loader.follow import JobFollower
from raypipe.loader.options import LoaderOptions
from raypipe.loader.prefetch import batch_stream
from raypipe.loader.stats import LoaderStats, WaitStats, WaitSummary
from raypipe.loader.token_loader import _rank_and_world
from raypipe.sampling.buffers import BatchBuffers, Filled, write_cu_seqlens
from raypipe.sampling.mixture_run import MixtureRun, MixtureStep
from raypipe.sampling.modes import BatchFiller


class MixtureLoader:
    def __init__(self, paths: dict[str, str | Path], seq_len: int | None = None,
                 batch_size: int | None = None, *, weights: dict[str, float] | None = None,
                 stages: list[tuple[int, dict[str, float]]] | None = None,
                 options: LoaderOptions | None = None, **knobs: Any):
        """`paths`: {source name: dataset path or URI}; `weights`: {name: weight} (default:
        by tokens); `stages`: [(first global step, {name: weight}), ...], the weights that
        follow `weights` from those steps, each stage's shares balanced on its own rows;
        options as TokenLoader's (raypipe.loader.options)."""
        self.options = options = LoaderOptions.of(options, seq_len, batch_size, **knobs)
        if options.metadata:
            raise ConfigError("mixture: stream metadata cannot be mixed")
        self.rank, self.world_size = _rank_and_world(options.rank, options.world_size)
        # each source a running tokenize job writes: its units as they commit
        self.followers = ({name: JobFollower(path, self.rank, self.world_size,
                                            options.follow_steps)
                           for name, path in sorted(paths.items())} if options.follow else {})
        self.run = MixtureRun.open(
            paths, options.plan, self.world_size, options.batch_size, weights=weights,
            stages=stages, rank=self.rank, batch_schedule=options.batch_schedule,
            seq_len_schedule=options.seq_len_schedule, format_name=options.format,
            cache_dir=options.cache_dir, cache_bytes=options.cache_bytes,
            pad_id=options.pad_id, boundaries=options.boundaries,
            units_join=options.units_join,
            manifests={name: follower.first_manifest(options.format)
                       for name, follower in self.followers.items()})
        self.names, self.sources = self.run.names, self.run.sources
        for name, follower in self.followers.items():
            if follower.active:
                self.sources[self.names.index(name)].refuse_following(
                    f"mixture source {name!r}, follow=True: a running job's units join")
        self.exclusions = PendingExclusions(  # excluded where the run starts, or resumes
            options.exclude, lambda: {name: source.planned.document_dataset for name, source
                                      in zip(self.names, self.sources, strict=True)},
            lambda what: self.sources[0].spec.loader_mode.refuse_an_exclusion(
                f"mixture: {what}"), self.rank)
        self.batch_size = self.sources[0].batch_size
        self.device = options.torch_device()
        self.state_name: str | None = None
        self._scratches: dict[tuple[int, int, int], BatchBuffers] = {}
        self.waits = WaitStats()

    @property
    def seq_len(self) -> int:
        """T of the next step's rows (the seq_len schedule's, at its step)."""
        return self.run.seq_len

    @property
    def global_batch(self) -> int:
        """Rows of the next global step (the batch schedule's, at its step)."""
        return self.run.batches.at(self.run.steps)

    @property
    def steps(self) -> int:
        """Global steps taken from the start of training."""
        return self.run.steps

    @property
    def weights_by_name(self) -> dict[str, float]:
        """The weights in force (those of the last step taken; before any, the first's)."""
        return self.run.weights_by_name

    @property
    def tokenizer(self) -> Any:
        """The sources' tokenizer (one for all)."""
        return self.sources[0].dataset.tokenizer

    # ----- filling a batch -----------------------------------------------------------------
    def _scratch(self, source: int, rows: int, seq_len: int, filler: BatchFiller
                 ) -> BatchBuffers:
        """A per-(source, row count, seq_len) buffer the source's rows are filled into
        first."""
        key = (source, rows, seq_len)
        if key not in self._scratches:
            self._scratches[key] = BatchBuffers.over(
                np.empty(BatchBuffers.size(rows, seq_len), dtype=np.int64), rows, seq_len)
            filler.prepare(self._scratches[key])
        return self._scratches[key]

    def _fill(self, job: MixtureStep, out: BatchBuffers) -> tuple[Filled, np.ndarray,
                                                                   np.ndarray]:
        observation_ids = np.empty(len(job.rows), dtype=np.int64)
        source_ids = np.array([source for source, _, _ in job.rows], dtype=np.int64)
        flags_by_row: list[np.ndarray] = [np.empty(0, bool)] * len(job.rows)
        seq_len = out.tokens.shape[1] - 1
        for key, (rows, plan) in job.groups.items():
            filler = self.run.filler(*key)
            scratch = self._scratch(key[0], len(rows), seq_len, filler)
            filled = filler.fill(plan, scratch)
            out.tokens[rows] = scratch.tokens
            out.position_ids[rows] = scratch.position_ids
            out.mask[rows] = scratch.mask
            observation_ids[rows] = plan.observation_ids
            starts = (scratch.position_ids == 0).sum(axis=1)
            flags = (filled.starts_document if filled.starts_document is not None
                     else np.ones(int(starts.sum()), bool))
            for row, piece in zip(rows, np.split(flags, np.cumsum(starts)[:-1]),
                                  strict=True):
                flags_by_row[row] = piece
        sequences = write_cu_seqlens(out, seq_len)
        return Filled(sequences, np.concatenate(flags_by_row)), observation_ids, source_ids

    # ----- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """Batches without end (each source cycles its epochs); stop after the steps you
        train. The state advances as each batch is taken; each step holds the batch
        schedule's rows (every rank its share)."""
        self._exclude()
        while True:
            steps = self.run.steps
            with closing(self._serve(self.global_batch // self.world_size, self.seq_len,
                                     self.run.batches.next_change(steps))) as batches:
                for batch in batches:  # units joining at the next step, recorded before
                    joined = self._followed()  # this batch is given (as TokenLoader's)
                    yield batch
                    if joined:
                        break  # a source's rest planned again from here

    def _followed(self) -> bool:
        """Following running jobs: every source's units committed since (on every rank the
        same) joined where the mixture stands now, at a check step; True where some did."""
        joined = False
        for name, follower in self.followers.items():
            if follower.due(self.run.steps):
                joined |= follower.check(
                    lambda manifest, key, name=name: self.run.join_units(name, manifest, key))
        return joined

    def _serve(self, rows: int, seq_len: int, until: int | None) -> Iterator[Any]:
        """The steps to `until` (None: without end), `rows` rows of `seq_len` per rank."""
        def fill(job: MixtureStep, views: BatchBuffers) -> tuple:
            return (job, *self._fill(job, views))

        def finish(views: BatchBuffers, meta: tuple) -> Batch:
            job, filled, observation_ids, source_ids = meta
            return Batch.of(views, filled, observation_ids=observation_ids,
                            positions=np.array([p for _, _, p in job.rows], dtype=np.int64),
                            epoch=-1, step=job.step, source_ids=source_ids,
                            mixture_state=job.after)

        prefetcher = batch_stream(self.run.rank_steps(until), fill, finish, rows,
                                  seq_len, self.options.dtype, self.device,
                                  self.options.prefetch, waits=self.waits)
        try:
            for batch in prefetcher:
                self.run.took(batch.step, batch.mixture_state)
                yield batch
        finally:
            prefetcher.close()

    @property
    def data_waits(self) -> WaitSummary:
        """How long the training thread waited for its batches (raypipe.loader.stats)."""
        return self.waits.summary()

    @property
    def stats(self) -> LoaderStats:
        """Waits per batch, and what the sources' caches fetched, summed, and hold against
        the budget (raypipe.loader.stats.LoaderStats)."""
        caches = [source.dataset.cache for source in self.sources
                  if source.dataset.cache is not None]
        if not caches:
            return LoaderStats(self.data_waits)
        fetched = CacheStats(*(sum(getattr(cache.stats, item.name) for cache in caches)
                               for item in fields(CacheStats)))
        return LoaderStats(self.data_waits, fetched, caches[0].budget_bytes,
                           caches[0].used_bytes())

    # ----- state (the run's) ----------------------------------------------------------------
    def knobs(self) -> dict[str, Any]:
        """The knobs that shape every source's observations (one set for all)."""
        return self.run.knobs()

    def state_dict(self) -> dict[str, Any]:
        self._exclude()
        return self.run.state().to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from any rank's `state_dict()` at any world size; new weights continue
        every source from its own position, a source added begins at its first row, and
        the documents of `exclude` the state does not hold are excluded from its step."""
        self.run.resume(state)
        self.exclusions.resumed()
        self._exclude()

    def _exclude(self) -> None:
        """Exclude the `exclude` option's documents from where the run stands, once."""
        self.exclusions.apply(self.run.exclude)

    def close(self) -> None:
        for source in self.sources:
            source.dataset.close()
