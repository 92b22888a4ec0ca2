"""TokenLoader: shuffled, packed, pinned batches for one data-parallel rank, with a small
state that resumes exactly, at any world size.

Invariant: the loader is a view of one `Run` (raypipe.sampling.run), which owns where the
run stands, its steps and its state: observations of epoch e are ordered by a pure function
of (dataset, seed, e); a global step consumes G = world_size x k consecutive positions (k =
batch_size rows, or one pre-formed batch; with a batch schedule, the schedule's G at that
step), position p + i*W + r going to rank r as its i-th observation of the step; every
observation of an epoch is served once except its drop-last tail (`dropped_tail`), and a
seq_len change, documents excluded (`exclude`), or units joining (a grown output, or a
running job's followed: raypipe.loader.follow) begin a phase (raypipe.sampling.schedule).
The loader keeps placement (this rank's rows into pinned host buffers, then the device),
prefetch (object storage: the shards of the steps described now, and those the shuffle
plans next) and tensors. Cost: see raypipe.sampling.buffers and raypipe.loader.prefetch; a
seq_len change, docs/scale.md.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError, FormatError
from raypipe.loader.batch import Batch
from raypipe.loader.exclusions import PendingExclusions
from raypipe.loader.follow import JobFollower, unfinished_output
from raypipe.loader.options import LoaderOptions
from raypipe.loader.prefetch import batch_stream
from raypipe.loader.reads import ReadAhead
from raypipe.loader.view import RunView
from raypipe.sampling.buffers import BatchBuffers, DescribedRows
from raypipe.sampling.mixture import is_mixture_spec
from raypipe.sampling.modes import BatchFiller, EpochPlan, PlanSpec
from raypipe.sampling.plans import PackingReport
from raypipe.sampling.run import Run
from raypipe.sampling.schedule import Phases, Segment

logger = logging.getLogger("raypipe")

__all__ = ["Batch", "TokenLoader"]


class TokenLoader(RunView):
    """Batches of one tokenized dataset for one rank. Options: raypipe.loader.options
    (keywords, or `options=LoaderOptions.of(...)`); a mixture of datasets is
    raypipe.loader.open_loader's."""

    def __init__(self, path: str | Path, seq_len: int | None = None,
                 batch_size: int | None = None, *, options: LoaderOptions | None = None,
                 **knobs: Any):
        """`path`: a dataset directory or URI (s3://, gs://, ...: shards come through the
        node-local cache at `cache_dir`, default $RAYPIPE_CACHE_DIR or ~/.cache/raypipe,
        holding at most `cache_bytes`, default $RAYPIPE_CACHE_BYTES or 64 GiB). `shuffle`:
        "auto" (the default: "global" for a local dataset, "windowed" on object storage),
        "global" (every observation anywhere), "windowed" (the documents of windows of
        `window_blocks` blocks of whole documents drawn from the whole corpus, a window at a
        time, sized from `cache_bytes`) or
        "shard_local" (groups of `group_shards` consecutive shards, one group at a time):
        see raypipe.sampling.plans. `split`: "all", "train" or "validation": documents are
        held out for validation by a hash of (dataset fingerprint, document index) with
        probability `validation_fraction` (raypipe.sampling.split); "train" shuffles the
        rest, "validation" serves the held-out documents in order, each once per epoch, the
        last step padded with empty rows (mask 0) instead of dropping any (documents
        mode)."""
        if isinstance(path, dict) or is_mixture_spec(path):
            raise ConfigError(f"TokenLoader reads one dataset; {path!r} is a mixture: "
                              "raypipe.open_loader(...) serves it (a MixtureLoader)")
        options = LoaderOptions.of(options, seq_len, batch_size, **knobs)
        self._open_view(options, str(path))
        if options.metadata and options.plan.split != "all":
            raise ConfigError("split with metadata=True is not supported")
        # a running tokenize job's output: its units as they commit (raypipe.loader.follow)
        self.follower = (JobFollower(path, self.rank, self.world_size, options.follow_steps)
                         if options.follow else None)
        manifest = (self.follower.first_manifest(options.format)
                    if self.follower is not None else None)
        try:
            self.run = Run.open(path, options.plan, self.world_size, options.batch_size,
                                rank=self.rank, format_name=options.format,
                                cache_dir=options.cache_dir,
                                cache_bytes=self.node.cache_bytes, node_ranks=self.node.ranks,
                                batch_schedule=options.batch_schedule,
                                seq_len_schedule=options.seq_len_schedule,
                                pad_id=options.pad_id, boundaries=options.boundaries,
                                units_join=options.units_join, manifest=manifest)
        except FormatError:
            unfinished = None if options.follow else unfinished_output(path)
            if unfinished is None:
                raise
            raise ConfigError(unfinished) from None
        if self.follower is not None and self.follower.active:
            self.run.data_changes.refuse_following(
                "follow=True: a running job's units join the run")
        split = self.run.planned.split
        if split is not None and self.rank == 0:
            logger.info("%s: split %r holds %s of %s documents (validation_fraction %s)",
                        self.dataset.root, split.name, f"{split.ids.size:,}",
                        f"{self.dataset.num_documents:,}", split.fraction)
        if options.metadata and not self.dataset.format.window_metadata:
            raise ConfigError(f"metadata=True needs mode {options.plan.mode!r} over a format "
                              f"whose windows carry metadata (of {self.dataset.format_name!r},"
                              " they do not)")
        if self.rank == 0 and self.dataset.cache is not None:
            self.run.note_shuffle()
        self.exclusions = PendingExclusions(  # excluded where the run starts, or resumes
            options.exclude, lambda: {None: self.run.planned.document_dataset},
            lambda what: self.spec.loader_mode.refuse_an_exclusion(
                f"{self.dataset.root}: {what}"), self.rank)

    # ----- the run's shape, as the Loader contract names it --------------------------------
    @property
    def dataset(self) -> TokenDataset | BatchDataset:
        """The documents the run serves (more of them once units joined)."""
        return self.run.dataset

    @property
    def spec(self) -> PlanSpec:
        return self.run.spec

    @property
    def batch_size(self) -> int:
        return self.run.batch_size

    @property
    def epoch(self) -> int:
        return self.run.epoch

    @property
    def position(self) -> int:
        """Observations of the current epoch's plan (its last phase's) consumed."""
        return self.run.position

    @property
    def dropped_tail(self) -> tuple[int, int, int] | None:
        """The last epoch that ended: (epoch, observations, tokens) its drop-last tail left."""
        return self.run.dropped_tail

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """Epoch `epoch`'s plan (the current epoch: under its phases, the rest of it)."""
        return self.run.plan(epoch)

    def steps_in_epoch(self, epoch: int | None = None) -> int:
        """Steps of epoch `epoch`'s plan at the current global batch."""
        return self.run.steps_in_epoch(epoch)

    def __len__(self) -> int:
        """Steps left in the current epoch (under the batch schedule)."""
        return self.run.steps_left()

    def packing_report(self, epoch: int | None = None) -> PackingReport:
        """What the epoch's rows make of the data (chat data: with its loss mask's count)."""
        return self.run.report(epoch)

    def filler(self, epoch: int, phases: Phases = ()) -> BatchFiller:
        """What describes and fills epoch `epoch`'s rows under `phases` (this rank's)."""
        return self.run.filler(epoch, phases)

    # ----- iteration --------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        """The remaining batches of the current epoch, each step of the schedule's global
        batch (its rows split evenly between the ranks); afterwards the epoch advances.
        Following a running job, units that joined re-plan the rest of the epoch, from the
        step they joined at."""
        run = self.run
        self._exclude()
        run.plan()  # checked: at least one global step, the waste warned of
        while (yield from self._serve_epoch()):
            pass  # units joined: the rest of the epoch from where the run stands
        run.end_epoch()

    def _serve_epoch(self) -> Iterator[Batch]:
        """The rest of the current epoch's batches; returns True where units joined the
        run after one of them (the epoch is not over). The join is made before that batch
        is given, so a state saved after it records the join (at the next step). Following
        a running job under units_join "epoch", an epoch whose plan is served waits for the
        job's next units instead of ending (JobFollower.wait_for_units): an epoch ends when
        the job does, so no epoch leaves out a unit the job commits."""
        run, fillers, follower = self.run, {}, self.follower
        join = run.data_changes.join_units
        for segment in run.epoch_segments():
            if segment.phases not in fillers:
                fillers = {segment.phases: run.filler(segment.epoch, segment.phases)}
            with closing(self._serve(fillers[segment.phases], segment)) as batches:
                for batch in batches:  # units joining at the next step, before this batch
                    joined = (follower is not None and follower.due(run.steps)  # is given:
                              and follower.check(join))  # its state records them
                    yield batch
                    if joined:
                        return True
        if follower is not None and follower.active and run.units_join == "epoch":
            return follower.wait_for_units(join, run.epoch,
                                           self.dataset.num_documents)
        return False

    def _serve(self, filler: BatchFiller, segment: Segment) -> Iterator[Batch]:
        """The segment's batches, the run advancing as each is taken."""
        with_metadata = self.options.metadata

        def fill(job: DescribedRows, views: BatchBuffers) -> tuple:
            filled = filler.fill(job, views)
            return job, filled, filler.metadata(job) if with_metadata else None

        def finish(views: BatchBuffers, meta: tuple) -> Batch:
            job, filled, metadata = meta
            return Batch.of(views, filled, observation_ids=job.observation_ids,
                            positions=job.positions, epoch=segment.epoch,
                            step=segment.step_at(int(job.positions[0])), metadata=metadata)

        steps = ReadAhead(self.run, filler, segment)
        prefetcher = batch_stream(iter(steps), fill, finish,
                                  self.run.rows_per_rank(segment), segment.seq_len,
                                  self.options.dtype, self.device, self.options.prefetch,
                                  filler.prepare, self.waits, steps.arrived)
        yield from self._served(prefetcher, lambda batch: self.run.took(segment, batch.step))

    def _datasets(self) -> list[Any]:
        return [self.dataset]

    def _exclude(self) -> None:
        """Exclude the `exclude` option's documents from where the run stands, once."""
        self.exclusions.apply(self.run.data_changes.exclude)
