"""MixtureLoader: batches drawn from several tokenized datasets at fixed weights, with a state
that resumes exactly, at any world size.

Invariant: the loader is a view of one `MixtureRun` (raypipe.sampling.mixture_run), which owns the
sources' positions, the split of each global step between them (raypipe.sampling.mixture:
every source within one row of its weight after every step, a pure function of the rows each
has served, so every rank and every resume computes the same split), the steps and the
state. The loader keeps placement (raypipe.loader.mixture_rows: slot j of a step goes to rank j
mod W, as in TokenLoader), prefetch (each source on object storage: the blocks or shards
of the next steps, raypipe.loader.reads) and tensors. Sources share one tokenizer (same sha256)
or the mixture is refused naming both. Cost per batch: one allocation (O(sources)) and one
describe and fill per source present in the rank's rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.errors import ConfigError
from raypipe.loader.batch import Batch
from raypipe.loader.exclusions import PendingExclusions
from raypipe.loader.follow import JobFollower
from raypipe.loader.mixture_rows import MixtureRows
from raypipe.loader.options import LoaderOptions
from raypipe.loader.prefetch import batch_stream
from raypipe.loader.reads import DESCRIBED_TOGETHER, StepReads, StepUnits
from raypipe.loader.view import RunView
from raypipe.sampling.buffers import BatchBuffers
from raypipe.sampling.mixture_run import MixtureRun, MixtureStep


class MixtureLoader(RunView):
    """Batches drawn from several tokenized datasets for one rank (see the module)."""

    def __init__(self, paths: dict[str, str | Path], seq_len: int | None = None,
                 batch_size: int | None = None, *, weights: dict[str, float] | None = None,
                 stages: list[tuple[int, dict[str, float]]] | None = None,
                 options: LoaderOptions | None = None, **knobs: Any):
        """`paths`: {source name: dataset path or URI}; `weights`: {name: weight} (default:
        by tokens); `stages`: [(first global step, {name: weight}), ...], the weights that
        follow `weights` from those steps, each stage's shares balanced on its own rows;
        options as TokenLoader's (raypipe.loader.options)."""
        options = LoaderOptions.of(options, seq_len, batch_size, **knobs)
        if options.metadata:
            raise ConfigError("mixture: stream metadata cannot be mixed")
        self._open_view(options, ", ".join(str(path) for _, path in sorted(paths.items())))
        # each source a running tokenize job writes: its units as they commit
        self.followers = ({name: JobFollower(path, self.rank, self.world_size,
                                            options.follow_steps)
                           for name, path in sorted(paths.items())} if options.follow else {})
        self.run = MixtureRun.open(
            paths, options.plan, self.world_size, options.batch_size, weights=weights,
            stages=stages, rank=self.rank, batch_schedule=options.batch_schedule,
            seq_len_schedule=options.seq_len_schedule, format_name=options.format,
            cache_dir=options.cache_dir, cache_bytes=self.node.cache_bytes,
            node_ranks=self.node.ranks, pad_id=options.pad_id, boundaries=options.boundaries,
            units_join=options.units_join,
            manifests={name: follower.first_manifest(options.format)
                       for name, follower in self.followers.items()})
        self.names, self.sources = self.run.names, self.run.sources
        for name, follower in self.followers.items():
            if follower.active:
                self.sources[self.names.index(name)].data_changes.refuse_following(
                    f"mixture source {name!r}, follow=True: a running job's units join")
        self.exclusions = PendingExclusions(  # excluded where the run starts, or resumes
            options.exclude, lambda: {name: source.planned.document_dataset for name, source
                                      in zip(self.names, self.sources, strict=True)},
            lambda what: self.sources[0].spec.loader_mode.refuse_an_exclusion(
                f"mixture: {what}"), self.rank)
        self.batch_size = self.sources[0].batch_size
        self.rows = MixtureRows(self.run)

    @property
    def weights_by_name(self) -> dict[str, float]:
        """The weights in force (those of the last step taken; before any, the first's)."""
        return self.run.weights_by_name

    # ----- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        """Batches without end (each source cycles its epochs); stop after the steps you
        train. The state advances as each batch is taken; each step holds the batch
        schedule's rows (every rank its share)."""
        self._exclude()
        while True:
            with closing(self._serve(*self.run.next_stretch())) as batches:
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

    def _serve(self, rows: int, seq_len: int, until: int | None) -> Iterator[Batch]:
        """The steps to `until` (None: without end), `rows` rows of `seq_len` per rank."""
        def fill(job: MixtureStep, views: BatchBuffers) -> tuple:
            return (job, *self.rows.fill(job, views))

        def finish(views: BatchBuffers, meta: tuple) -> Batch:
            job, filled, observation_ids, source_ids = meta
            return Batch.of(views, filled, observation_ids=observation_ids,
                            positions=np.array([p for _, _, p in job.rows], dtype=np.int64),
                            epoch=-1, step=job.step, source_ids=source_ids,
                            mixture_state=job.after)

        steps = StepReads(self.run.rank_steps(until, DESCRIBED_TOGETHER), self._step_units,
                          self._datasets())
        prefetcher = batch_stream(iter(steps), fill, finish, rows, seq_len,
                                  self.options.dtype, self.device, self.options.prefetch,
                                  waits=self.waits, ready=steps.arrived)
        yield from self._served(prefetcher,
                                lambda batch: self.run.took(batch.step, batch.mixture_state))

    def _step_units(self, job: MixtureStep) -> StepUnits:
        """What a step reads of each source on object storage (its units of fetch)."""
        return [(key[0], self.run.filler(*key).job_units(described))
                for key, (_, described) in job.groups.items()
                if self.sources[key[0]].dataset.cache is not None]

    def _datasets(self) -> list[Any]:
        return [source.dataset for source in self.sources]
