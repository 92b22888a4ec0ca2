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
from collections import deque
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raypipe.errors import ConfigError, FormatError
from raypipe.io.cache import CacheStats
from raypipe.io.records import TokenizerInfo
from raypipe.loader.batch import Batch
from raypipe.loader.exclusions import PendingExclusions
from raypipe.loader.follow import JobFollower, unfinished_output
from raypipe.loader.options import LoaderOptions
from raypipe.loader.prefetch import batch_stream
from raypipe.loader.stats import LoaderStats, WaitStats, WaitSummary
from raypipe.sampling.buffers import BatchBuffers, DescribedRows
from raypipe.sampling.mixture import is_mixture_spec
from raypipe.sampling.modes import BatchFiller
from raypipe.sampling.plans import PackingReport
from raypipe.sampling.run import Run
from raypipe.sampling.schedule import Phases, Segment

logger = logging.getLogger("raypipe")
FETCHES_NAMED = 3  # shards a slow-wait line names
READ_AHEAD_STEPS = 64  # a dataset read in blocks: steps described ahead of the one served
DESCRIBED_TOGETHER = 8  # ... described a few at a time, before each step served

__all__ = ["Batch", "TokenLoader"]


class TokenLoader:
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
        self.options = options = LoaderOptions.of(options, seq_len, batch_size, **knobs)
        self.rank, self.world_size = _rank_and_world(options.rank, options.world_size)
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
                                cache_dir=options.cache_dir, cache_bytes=options.cache_bytes,
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
            self.run.refuse_following("follow=True: a running job's units join the run")
        split = self.run.planned.split
        if split is not None and self.rank == 0:
            logger.info("%s: split %r holds %s of %s documents (validation_fraction %s)",
                        self.dataset.root, split.name, f"{split.ids.size:,}",
                        f"{self.dataset.num_documents:,}", split.fraction)
        if options.metadata and not self.dataset.format.window_metadata:
            raise ConfigError(f"metadata=True needs mode {options.plan.mode!r} over a format "
                              f"whose windows carry metadata (of {self.dataset.format_name!r},"
                              " they do not)")
        self.state_name: str | None = None  # where adapters (raypipe.ray.train) keep its state
        self.device = options.torch_device()
        self.waits = WaitStats(describe=self._fetching_now)
        if self.rank == 0 and self.dataset.cache is not None:
            self.run.note_shuffle()
        self.exclusions = PendingExclusions(  # excluded where the run starts, or resumes
            options.exclude, lambda: {None: self.run.planned.document_dataset},
            lambda what: self.spec.loader_mode.refuse_an_exclusion(
                f"{self.dataset.root}: {what}"), self.rank)

    # ----- the run's shape, as the Loader contract names it --------------------------------
    @property
    def dataset(self) -> Any:
        """The documents the run serves (more of them once units joined)."""
        return self.run.dataset

    @property
    def spec(self) -> Any:
        return self.run.spec

    @property
    def batch_size(self) -> int:
        return self.run.batch_size

    @property
    def global_batch(self) -> int:
        """Observations consumed by the next global step (the schedule's, at its step)."""
        return self.run.global_batch

    @property
    def seq_len(self) -> int:
        """T of the next step's rows (the schedule's, at its step)."""
        return self.run.seq_len

    @property
    def epoch(self) -> int:
        return self.run.epoch

    @property
    def position(self) -> int:
        """Observations of the current epoch's plan (its last phase's) consumed."""
        return self.run.position

    @property
    def steps(self) -> int:
        """Global steps taken from the start of training."""
        return self.run.steps

    @property
    def dropped_tail(self) -> tuple[int, int, int] | None:
        """The last epoch that ended: (epoch, observations, tokens) its drop-last tail left."""
        return self.run.dropped_tail

    def plan(self, epoch: int | None = None) -> Any:
        """Epoch `epoch`'s plan (the current epoch: under its phases, the rest of it)."""
        return self.run.plan(epoch)

    def steps_in_epoch(self, epoch: int | None = None) -> int:
        """Steps of epoch `epoch`'s plan at the current global batch."""
        return self.plan(epoch).size // self.global_batch

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
        for segment in run.epoch_segments():
            if segment.phases not in fillers:
                fillers = {segment.phases: run.filler(segment.epoch, segment.phases)}
            with closing(self._serve(fillers[segment.phases], segment)) as batches:
                for batch in batches:  # units joining at the next step, before this batch
                    joined = (follower is not None and follower.due(run.steps)  # is given:
                              and follower.check(run.join_units))  # its state records them
                    yield batch
                    if joined:
                        return True
        if follower is not None and follower.active and run.units_join == "epoch":
            return follower.wait_for_units(run.join_units, run.epoch,
                                           self.dataset.num_documents)
        return False

    def _jobs(self, filler: BatchFiller, segment: Segment) -> Iterator[DescribedRows]:
        """This rank's described steps of the segment (object storage: their shards
        fetched ahead, then those the shuffle plans next or, where it plans none, those of
        the next chunk of steps; the shards of windows already read are closed; a dataset
        read in blocks: `_read_ahead`)."""
        if getattr(self.dataset, "blocks", None) is not None:
            yield from self._read_ahead(filler, segment)
            return
        for positions, following in self.run.rank_chunks(segment):
            if self.dataset.cache is not None:
                needed = filler.fetch_units(positions).tolist()
                self.dataset.prefetch(needed)
                ahead = filler.units_ahead(int(positions[0, 0]))
                if ahead is not None:
                    self.dataset.close_except([*needed, *ahead.tolist()])
                    self.dataset.prefetch(ahead.tolist())
                elif following is not None:
                    self.dataset.prefetch(filler.fetch_units(following).tolist())
            yield from filler.describe(positions)

    def _read_ahead(self, filler: BatchFiller, segment: Segment) -> Iterator[DescribedRows]:
        """The segment's described steps (a dataset read in blocks), the blocks each step
        reads fetched ahead in the order the steps read them, as far as the rank's share
        of the node cache holds, over the next READ_AHEAD_STEPS steps (described
        DESCRIBED_TOGETHER at a time, one such call before each step served, so no step
        waits behind a long description), and the blocks of steps already served let go:
        before each step, every read the next steps need is in flight."""
        chunks = self.run.rank_chunks(segment)
        undescribed: deque[np.ndarray] = deque()  # steps' positions, one row a step
        pending: deque[tuple[DescribedRows, np.ndarray]] = deque()
        while True:
            if len(pending) < READ_AHEAD_STEPS:  # a few steps described before each step
                if not undescribed:             # served, so no step waits for many
                    chunk = next(chunks, None)
                    undescribed.extend(() if chunk is None else chunk[0])
                few = [undescribed.popleft()
                       for _ in range(min(DESCRIBED_TOGETHER, len(undescribed)))]
                if few:
                    pending.extend((job, filler.job_units(job))
                                   for job in filler.describe(np.stack(few)))
            if not pending:
                return
            upcoming = list(dict.fromkeys(int(unit) for _, units in pending
                                          for unit in units.tolist()))
            self.dataset.close_except(upcoming)
            self.dataset.prefetch(upcoming)
            yield pending.popleft()[0]

    def _serve(self, filler: BatchFiller, segment: Segment) -> Iterator[Batch]:
        """The segment's batches, the run advancing as each is taken."""
        with_metadata = self.options.metadata

        def fill(job: DescribedRows, views: BatchBuffers) -> tuple:
            filled = filler.fill(job, views)
            return job, filled, filler.metadata(job) if with_metadata else None

        def finish(views: BatchBuffers, meta: tuple) -> Batch:
            job, filled, metadata = meta
            index = (int(job.positions[0]) - segment.position) // segment.global_batch
            return Batch.of(views, filled, observation_ids=job.observation_ids,
                            positions=job.positions, epoch=segment.epoch,
                            step=segment.step + index, metadata=metadata)

        observations = segment.global_batch // self.world_size  # this rank's, per step
        per_step = self.run.planned.observations_per_step
        rows = self.batch_size * observations // per_step  # pre-formed: B
        prefetcher = batch_stream(self._jobs(filler, segment), fill, finish, rows,
                                  segment.seq_len, self.options.dtype, self.device,
                                  self.options.prefetch, filler.prepare, self.waits)
        try:
            for batch in prefetcher:
                self.run.took(segment, batch.step)
                yield batch
        finally:
            prefetcher.close()

    @property
    def tokenizer(self) -> TokenizerInfo:
        """The tokenizer as this loader's format holds it (its own separators, where the
        job gave formats their own)."""
        return self.dataset.tokenizer

    def close(self) -> None:
        """Stop background shard fetches and close open shards (object storage)."""
        self.dataset.close()

    # ----- what it cost -----------------------------------------------------------------
    @property
    def data_waits(self) -> WaitSummary:
        """How long the training thread waited for its batches (raypipe.loader.stats):
        p50, p99 and max after the first batch, their sum, and the first batch's;
        `.metrics()` for a report."""
        return self.waits.summary()

    @property
    def stats(self) -> LoaderStats:
        """Waits per batch, and what the node cache fetched (bytes, files, retries) and
        holds against its budget (raypipe.loader.stats.LoaderStats; `.metrics()`)."""
        cache = self.dataset.cache
        if cache is None:
            return LoaderStats(self.data_waits)
        return LoaderStats(self.data_waits, cache.stats, cache.budget_bytes, cache.used_bytes())

    def _fetching_now(self) -> str:
        """What the loader was doing while a batch was late: the shards on their way from
        object storage, by name, and its cache's counts."""
        stats = self.cache_stats
        if stats is None:
            return ""
        names = self.dataset.fetching_now()
        shown = ", ".join(names[:FETCHES_NAMED]) + (f" and {len(names) - FETCHES_NAMED} more"
                                                    if len(names) > FETCHES_NAMED else "")
        return (f"waiting on {shown or 'no shard'} of {self.dataset.root} (the first: the one "
                f"the next batch opens, if any); cache so far: {stats.downloads} downloads, "
                f"{stats.downloaded_bytes:,} bytes, {stats.retries} retries, "
                f"{stats.evicted_files} evictions, budget {self.dataset.cache.budget_bytes:,}")

    @property
    def cache_stats(self) -> CacheStats | None:
        """Downloads, hits and evictions of this loader's shard cache (None when local)."""
        return None if self.dataset.cache is None else self.dataset.cache.stats

    # ----- state (the run's) ------------------------------------------------------------
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
        """Exclude the `exclude` option's documents from where the run stands, once."""
        self.exclusions.apply(lambda by_source: self.run.exclude(*by_source[None]))


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        distributed = torch.distributed
        if distributed.is_available() and distributed.is_initialized():
            rank = distributed.get_rank() if rank is None else rank
            world_size = distributed.get_world_size() if world_size is None else world_size
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} not in [0, world_size={world_size})")
    return rank, world_size
