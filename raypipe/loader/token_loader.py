"""TokenLoader: shuffled, packed, pinned batches for one data-parallel rank, with a small
state that resumes exactly, at any world size.

Invariant: observations of epoch e are ordered by a pure function of (dataset, seed, e)
(raypipe.sampling.plans). A global step consumes G = world_size x k consecutive positions
(k = batch_size rows, or k = 1 pre-formed LLMBATCH batch; with a batch schedule, G is the
schedule's at that step: raypipe.sampling.schedule); position p + i*W + r goes to rank r
as its i-th observation of the step. `state_dict()` is the same on every rank: {epoch,
position = observations consumed by all ranks, steps = global steps taken, phases = the
epoch's seq_len phases when it changed inside it, history = the run's shape at each
change}, plus the dataset fingerprint and the knobs that shape observations. Loading it on
any rank of any world size continues the same global order, so over a run every
observation of an epoch is consumed exactly once, except the last (size mod G) positions
of each epoch (drop-last; `dropped_tail` counts them, rank 0 logs them). A seq_len other
than the phase's (a schedule's step, or a loader resumed at another seq_len) begins a
phase: the rest of the epoch planned again from what was not served, so every token is
still trained once (raypipe.sampling.schedule). Cost: see raypipe.sampling.batches and
raypipe.loader.prefetch; a seq_len change, docs/scale.md.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raypipe.errors import ConfigError, StateError
from raypipe.io.cache import CacheStats
from raypipe.io.records import TokenizerInfo
from raypipe.io.states import STATE_VERSION, LoaderState
from raypipe.loader.batch import Batch
from raypipe.loader.options import LoaderOptions
from raypipe.loader.prefetch import batch_stream
from raypipe.loader.stats import LoaderStats, WaitStats, WaitSummary
from raypipe.sampling.batches import BatchBuffers, BatchPlan
from raypipe.sampling.epochs import PlannedDataset
from raypipe.sampling.mixture import is_mixture_spec
from raypipe.sampling.modes import (
    BatchFiller,
    describe_shuffle,
    knob_differences,
    upgrade_knobs,
    waste_hints,
)
from raypipe.sampling.plans import WASTE_WARNING, PackingReport, window_shards_for
from raypipe.sampling.schedule import (
    Cursor,
    Phase,
    Phases,
    Segment,
    phase_rows,
    phases_of_rows,
)

logger = logging.getLogger("raypipe")
FETCHES_NAMED = 3  # shards a slow-wait line names
DESCRIBE_STEPS = 64

__all__ = ["Batch", "TokenLoader"]


class TokenLoader:
    """Batches of one tokenized dataset for one rank. Options: raypipe.loader.options
    (keywords, or `options=LoaderOptions(...)`); a mixture of datasets is
    raypipe.loader.open_loader's."""

    def __init__(self, path: str | Path, seq_len: int | None = None,
                 batch_size: int | None = None, *, options: LoaderOptions | None = None,
                 **knobs: Any):
        """`path`: a dataset directory or URI (s3://, gs://, ...: shards come through the
        node-local cache at `cache_dir`, default $RAYPIPE_CACHE_DIR or ~/.cache/raypipe,
        holding at most `cache_bytes`, default $RAYPIPE_CACHE_BYTES or 64 GiB). `shuffle`:
        "auto" (the default: "global" for a local dataset, "windowed" on object storage),
        "global" (every observation anywhere), "windowed" (the documents of windows of
        `window_shards` shards drawn from the whole corpus, a window at a time) or
        "shard_local" (groups of `group_shards` consecutive shards, one group at a time):
        see raypipe.sampling.plans. `split`:
        "all", "train" or "validation": documents are held out for validation by a hash of
        (dataset fingerprint, document index) with probability `validation_fraction`
        (raypipe.sampling.split); "train" shuffles the rest (documents, bestfit; windows
        over the train documents back to back),
        "validation" serves the held-out documents in order, each once per epoch, the last
        step padded with empty rows (mask 0) instead of dropping any (documents mode)."""
        if isinstance(path, dict) or is_mixture_spec(path):
            raise ConfigError(f"TokenLoader reads one dataset; {path!r} is a mixture: "
                              "raypipe.open_loader(...) serves it (a MixtureLoader)")
        self.options = options = LoaderOptions.of(options, seq_len, batch_size, **knobs)
        self.rank, self.world_size = _rank_and_world(options.rank, options.world_size)
        self.mode, self.seed = options.mode, options.seed
        spec = options.plan_spec(options.first_seq_len or 0)
        if options.metadata and spec.split != "all":
            raise ConfigError("split with metadata=True is not supported")
        self.planned = PlannedDataset.open(path, spec, self.world_size, options.batch_size,
                                           options.format, options.cache_dir,
                                           options.cache_bytes,
                                           batch_schedule=list(options.batch_schedule or []),
                                           seq_len_schedule=list(options.seq_len_schedule
                                                                 or []))
        self.dataset: Any = self.planned.dataset
        self.spec, self.split, self.source = (self.planned.spec, self.planned.split,
                                              self.planned.source)
        self.batch_size = self.planned.batch_size
        if self.split is not None and self.rank == 0:
            logger.info("%s: split %r holds %s of %s documents (validation_fraction %s)",
                        self.dataset.root, self.split.name, f"{self.split.ids.size:,}",
                        f"{self.dataset.num_documents:,}", self.split.fraction)
        if options.metadata and not self.dataset.format.window_metadata:
            raise ConfigError(f"metadata=True needs mode {self.mode!r} over a format whose "
                              f"windows carry metadata (of {self.dataset.format_name!r}, "
                              "they do not)")
        self.state_name: str | None = None  # where adapters (raypipe.ray.train) keep its state
        self._warned = False
        # document boundaries (position_ids, cu_seqlens): on for packed/document rows; for
        # windows only when asked (a BOS scan per batch)
        self.boundaries = (self.spec.loader_mode.boundaries_by_default
                           if options.boundaries is None else options.boundaries)
        self.device = options.torch_device()
        self.epoch, self.position, self.steps = 0, 0, 0
        self.schedule = self.planned.schedule
        self.plans = self.planned.plans
        self.phases = self.planned.first_phases  # the current epoch's seq_len phases
        self.history: list[list[int]] = []  # [step, global batch, seq_len] at each change
        self.waits = WaitStats(describe=self._fetching_now)
        if self.rank == 0 and self.dataset.cache is not None:
            self._note_shuffle()
        # the last epoch that ended: (epoch, observations, tokens) its drop-last tail left
        self.dropped_tail: tuple[int, int, int] | None = None

    def _note_shuffle(self) -> None:
        """Say which shuffle reads the bucket, and warn when the node cache is smaller than
        what it holds: the windows of this node's ranks (LOCAL_WORLD_SIZE, as torchrun and
        Ray Train set it; two a rank: the one read and the next) and every index file."""
        dataset, spec = self.dataset, self.spec
        logger.info("%s: shuffle %s", dataset.root, describe_shuffle(spec, dataset.num_shards))
        shard_bytes = [sum(entry.bytes for entry in shard.files) for shard in dataset.shards]
        if spec.shuffle != "windowed" or not shard_bytes:
            if (spec.shuffle == "global" and spec.loader_mode.windowed
                    and sum(shard_bytes) > dataset.cache.budget_bytes):
                logger.warning("%s: the global shuffle reads every shard throughout the epoch "
                               "and the cache holds less than the dataset, so shards are "
                               "fetched many times; shuffle='auto' (windowed) fetches each "
                               "once", dataset.root)
            return
        window = window_shards_for(dataset.num_shards, spec.window_shards, max(spec.lanes, 1))
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        index = sum(entry.bytes for shard in dataset.shards for entry in shard.files
                    if entry.path.endswith(tuple(dataset.format.index_suffixes)))
        needed = ranks * 2 * window * max(shard_bytes) + index
        if needed > dataset.cache.budget_bytes:
            logger.warning("%s: the node cache (%s bytes) is smaller than what the windowed "
                           "shuffle holds (%s bytes: %d rank(s) x 2 windows of %d shard(s), "
                           "and the index files), so shards will be fetched again; raise "
                           "cache_bytes or give a smaller window_shards (docs/cluster.md)",
                           dataset.root, f"{dataset.cache.budget_bytes:,}", f"{needed:,}",
                           ranks, window)

    # ----- the epoch plan -------------------------------------------------------------
    @property
    def observations_per_batch(self) -> int:
        """Observations one rank takes per step: rows, or one pre-formed batch."""
        return self.planned.observations_per_step

    @property
    def global_batch(self) -> int:
        """Observations consumed by the next global step (the schedule's, at its step)."""
        return self.schedule.at(self.steps)

    @property
    def seq_len(self) -> int:
        """T of the next step's rows (the schedule's, at its step)."""
        return self.schedule.seq_len_at(self.steps) or self.spec.seq_len

    def cursor(self) -> Cursor:
        """Where the loader stands: the next step's epoch, phases, position and number."""
        return Cursor(self.epoch, self.position, self.steps, self.phases)

    def plan(self, epoch: int | None = None) -> Any:
        """Epoch `epoch`'s plan (the current epoch: under its phases, the rest of it)."""
        epoch = self.epoch if epoch is None else epoch
        plan = self.plans(epoch, self.phases if epoch == self.epoch
                          else self.planned.first_phases)
        if plan.size < self.global_batch and len(self.phases) == 1:
            raise ConfigError(
                f"{self.dataset.root}: epoch {epoch} has {plan.size} observations, fewer "
                f"than one global step (world_size {self.world_size} x batch_size "
                f"{self.observations_per_batch}): every rank would get no batch")
        if not self._warned and self.rank == 0:  # one warning per loader, not per rank
            self._warned = plan.report().warn_if_wasteful(
                f"TokenLoader({self.dataset.root}, mode={self.mode!r}"
                + (f", packing={self.spec.packing!r}" if self.spec.packed else "")
                + (f", overlong={self.spec.resolved_overlong!r}"
                   if self.spec.packed and self.spec.resolved_overlong != "cut" else "")
                + f", seq_len={self.seq_len}) epoch {epoch}",
                waste_hints(self.mode, self.spec.packing, self.dataset.has_loss_mask))
        return plan

    def prepare_epoch(self, epoch: int) -> threading.Thread:
        """Start building epoch `epoch`'s plan on a background thread into the node's plan
        cache, so the epoch boundary loads it (bestfit: its block sums) instead of
        computing it; the loader calls it itself halfway through an epoch."""
        first_phase = (Phase(self.seq_len),)  # the seq_len the next epoch starts at

        def build() -> None:
            try:
                self.plans.build(epoch, first_phase).report()
            except Exception as exc:  # noqa: BLE001  (the boundary computes it again)
                logger.warning("preparing epoch %d's plan in the background failed (%s); "
                               "the epoch boundary will build it", epoch, exc)

        thread = threading.Thread(target=build, name=f"raypipe-plan-{epoch}", daemon=True)
        thread.start()
        return thread

    def steps_in_epoch(self, epoch: int | None = None) -> int:
        """Steps of epoch `epoch`'s plan at the current global batch (the current epoch:
        of its last phase's plan, from its start)."""
        return self.plan(epoch).size // self.global_batch

    def __len__(self) -> int:
        """Steps left in the current epoch (under the batch schedule)."""
        return sum(segment.steps for segment in self._segments())

    def _segments(self) -> Iterator[Segment]:
        """The rest of the current epoch's steps, as runs of one global batch."""
        yield from self.planned.segments(self.cursor(), one_epoch=True)

    def packing_report(self, epoch: int | None = None) -> PackingReport:
        """What the epoch's rows make of the data (chat data: with its loss mask's count)."""
        report = self.plan(epoch).report()
        trained = getattr(self.dataset.manifest.totals, "trained_tokens", None)
        if trained is None:
            return report
        lengths = (chunk for _, chunk in self.planned.document_lengths().chunks())
        return report.with_loss_mask(trained, lengths, self.spec.packing, self.seq_len,
                                     self.spec.resolved_overlong)

    # ----- iteration --------------------------------------------------------------------
    def filler(self, epoch: int, phases: Phases = ()) -> BatchFiller:
        """What describes and fills this loader's batches of epoch `epoch` under `phases`
        (its mode's filler over this rank's view of the dataset): a MixtureLoader fills its
        sources' rows with it, `raypipe trace` asks it what rows hold."""
        if not phases:
            self.plan(epoch)  # checked: at least one global step
        return self.planned.filler(epoch, self.options.pad_id, self.boundaries, phases)

    def _jobs(self, builder: Any, segment: Segment) -> Iterator[BatchPlan]:
        """BatchPlans of this rank for the segment's steps, described DESCRIBE_STEPS at a
        time (one vectorized permutation call per chunk, not per batch); the first chunk is
        one step, so the first batch waits for one step's description, not 64."""
        offsets = self.planned.rank_positions(0, self.rank, segment.global_batch)[0]
        steps = segment.steps
        half = self.plans(segment.epoch, segment.phases).size // 2
        bounds = sorted({0, min(1, steps), *range(DESCRIBE_STEPS, steps, DESCRIBE_STEPS),
                         steps})

        def chunk(index: int) -> np.ndarray:
            steps_here = np.arange(bounds[index], bounds[index + 1], dtype=np.int64)
            return segment.position + steps_here[:, None] * segment.global_batch + offsets

        for index in range(len(bounds) - 1):
            if (segment.step_start(bounds[index]) <= half < segment.step_start(bounds[index + 1])
                    and self.spec.loader_mode.prepares_next_epoch(self.spec)):
                self.prepare_epoch(segment.epoch + 1)
            positions = chunk(index)
            if self.dataset.cache is not None:
                self._fetch_ahead(builder, positions,
                                  chunk(index + 1) if index + 2 < len(bounds) else None)
            yield from builder.describe(positions)

    def _fetch_ahead(self, builder: Any, positions: np.ndarray,
                     following: np.ndarray | None) -> None:
        """Object storage: fetch the shards of the steps described now, then those the
        shuffle plans next (a windowed one: the next window's, and the shards of windows
        already read are closed) or, where it plans none, those of the next chunk of steps
        (`following`)."""
        needed = builder.shards(positions).tolist()
        self.dataset.prefetch(needed)
        ahead = builder.shards_ahead(int(positions[0, 0]))
        if ahead is not None:
            self.dataset.close_except([*needed, *ahead.tolist()])
            self.dataset.prefetch(ahead.tolist())
        elif following is not None:
            self.dataset.prefetch(builder.shards(following).tolist())

    def __iter__(self) -> Iterator[Batch]:
        """The remaining batches of the current epoch, each step of the schedule's global
        batch (its rows split evenly between the ranks); afterwards the epoch advances."""
        epoch, builders = self.epoch, {}
        self.plan(epoch)  # checked: at least one global step, the waste warned of
        for segment in list(self._segments()):
            if segment.phases not in builders:
                builders = {segment.phases: self.filler(epoch, segment.phases)}
            self._note_shape(segment)
            yield from self._serve(builders[segment.phases], segment)
        self._note_tail()
        self.epoch, self.position = epoch + 1, 0
        self.phases = (Phase(self.phases[-1].seq_len),)

    def _note_tail(self) -> None:
        """Count (and log, on rank 0) what the epoch that just ended left as its drop-last
        tail: `dropped_tail` is (epoch, observations, tokens); a warning when the tokens
        pass WASTE_WARNING of the epoch's."""
        rows, tokens = self.planned.left_at(self.epoch, self.phases, self.position)
        self.dropped_tail = (self.epoch, rows, tokens)
        if not rows or self.rank != 0:
            return
        total = self.planned.epoch_tokens() if tokens else 0
        share = tokens / total if total else 0.0
        log = logger.warning if share > WASTE_WARNING else logger.info
        log("%s: epoch %d ends with %d observations (%d tokens, %.1f%% of the epoch's) under "
            "one global step left untrained (drop-last)%s", self.dataset.root, self.epoch,
            rows, tokens, 100 * share, "; hint: a smaller global batch, or a longer epoch "
            "(more data), leaves less" if share > WASTE_WARNING else "")

    def _note_shape(self, segment: Segment) -> None:
        """Record the segment's (global batch, seq_len) in the run's history where it
        changes."""
        shape = [segment.global_batch, segment.seq_len]
        if not self.history or self.history[-1][1:] != shape:
            self.history.append([segment.step, *shape])

    def _serve(self, builder: BatchFiller, segment: Segment) -> Iterator[Batch]:
        """The segment's batches, the state advancing as each is taken."""
        with_metadata = self.options.metadata

        def fill(job: BatchPlan, views: BatchBuffers) -> tuple:
            filled = builder.fill(job, views)
            return job, filled, builder.metadata(job) if with_metadata else None

        def finish(views: BatchBuffers, meta: tuple) -> Batch:
            job, filled, metadata = meta
            index = (int(job.positions[0]) - self.rank - segment.position) // \
                segment.global_batch
            return Batch.of(views, filled, observation_ids=job.observation_ids,
                            positions=job.positions, epoch=segment.epoch,
                            step=segment.step + index, metadata=metadata)

        observations = segment.global_batch // self.world_size  # this rank's, per step
        rows = self.batch_size * observations // self.observations_per_batch  # pre-formed: B
        prefetcher = batch_stream(self._jobs(builder, segment), fill, finish,
                                  rows, segment.seq_len, self.options.dtype,
                                  self.device, self.options.prefetch, builder.prepare,
                                  self.waits)
        try:
            for batch in prefetcher:
                self.position = int(batch.positions[0]) - self.rank + segment.global_batch
                self.steps, self.phases = batch.step + 1, segment.phases
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

    @property
    def data_waits(self) -> WaitSummary:
        """How long the training thread waited for its batches (raypipe.loader.stats):
        p50, p99 and max after the first batch, their sum, and the first batch's;
        `.metrics()` for a report."""
        return self.waits.summary()

    @property
    def stats(self) -> LoaderStats:
        """Waits per batch, and what the node cache fetched (bytes, files, retries) and
        holds against its budget (raypipe.loader.stats.LoaderStats; `.metrics()` for a
        report)."""
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

    # ----- state ------------------------------------------------------------------------
    def knobs(self) -> dict[str, Any]:
        """The knobs that shape this loader's observations (its state records them; seq_len:
        the current phase's)."""
        return self.plans.at_seq_len(self.phases[-1].seq_len).knobs_record()

    def state_dict(self) -> dict[str, Any]:
        return LoaderState(STATE_VERSION, self.dataset.fingerprint, self.dataset.format_name,
                           self.knobs(), self.epoch, self.position,
                           {"world_size": self.world_size, "batch_size": self.batch_size},
                           self.steps,
                           phase_rows(self.phases) if len(self.phases) > 1 else None,
                           [list(entry) for entry in self.history] or None).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state` (any rank's `state_dict()`, any world size)."""
        checked = LoaderState.from_dict(state)
        if checked.dataset != self.dataset.fingerprint:
            raise StateError(
                f"loader state was made for dataset {checked.dataset!r} but "
                f"{self.dataset.root} is {self.dataset.fingerprint!r}: a shard or the manifest "
                "changed since the checkpoint")
        self.adopt_shuffle(checked.knobs)
        saved_seq_len = checked.knobs.get("seq_len", self.spec.seq_len)
        refused = knob_differences(checked.knobs, {**self.spec.knobs_record(),
                                                   "seq_len": saved_seq_len})
        if refused:
            raise StateError(f"loader state made with other knobs than this loader's: "
                             f"{refused} (these cannot change on a resume; seq_len, batch "
                             "size, world size and a schedule can)")
        phases = phases_of_rows(checked.phases, saved_seq_len)
        epoch, position = checked.epoch, checked.position
        size = self.plans(epoch, phases).size
        if position > size:
            raise StateError(f"loader state position {position} outside epoch {epoch} "
                             f"(size {size})")
        self.epoch, self.position, self.phases = epoch, position, phases
        self.steps = (checked.steps if checked.steps is not None else
                      self.schedule.steps_before(self.planned.plan_size, epoch, position,
                                                 phases))
        self.history = [list(entry) for entry in checked.history or []]
        self._plan_the_change()

    def adopt_shuffle(self, saved_knobs: dict[str, Any]) -> None:
        """A loader given shuffle "auto" resumes under the shuffle its state was made with
        (a state of an earlier release, or of a run that resolved it otherwise: global),
        and one given window_shards or lanes 0 under the state's (the lanes of the world
        size it started at); a value given must match instead (checked with the other
        knobs)."""
        knobs, given = upgrade_knobs(saved_knobs), self.options
        shuffle = knobs["shuffle"] if given.shuffle == "auto" else self.spec.shuffle
        window = (knobs.get("window_shards", 0) if given.window_shards == 0
                  else self.spec.window_shards)
        lanes = knobs.get("lanes", 0) if given.lanes == 0 else self.spec.lanes
        self.use_shuffle(shuffle, window, lanes, "as the loader state was made")

    def use_shuffle(self, shuffle: str, window_shards: int, lanes: int, why: str) -> None:
        """Plan under `shuffle` (its window and lanes) instead of what "auto" resolved to;
        no-op where they are the same."""
        layout = (shuffle, window_shards, lanes)
        if layout == (self.spec.shuffle, self.spec.window_shards, self.spec.lanes):
            return
        resolved = describe_shuffle(self.spec, self.dataset.num_shards)
        spec = replace(self.spec, shuffle=shuffle, window_shards=window_shards, lanes=lanes)
        self.planned = PlannedDataset(self.dataset, spec, self.world_size, self.batch_size,
                                      self.options.cache_dir, schedule=self.planned.schedule)
        self.spec, self.plans = self.planned.spec, self.planned.plans
        if self.rank == 0:
            logger.info("%s: shuffle %s, %s (auto resolved it to %s)", self.dataset.root,
                        describe_shuffle(self.spec, self.dataset.num_shards), why, resolved)

    def _plan_the_change(self) -> None:
        """A seq_len other than the saved one: the rest of the epoch planned now (a mode
        that cannot is refused here, naming the change, not at the first batch)."""
        if self.seq_len == self.phases[-1].seq_len:
            return
        cursor = self.schedule.phases_at(self.cursor())
        try:
            self.plans(cursor.epoch, cursor.phases)
        except ConfigError as exc:
            raise StateError(f"loader state: {exc}") from None
        if self.rank == 0:
            logger.info("%s: seq_len %d -> %d from step %d: the rest of epoch %d is planned "
                        "again at %d from what the saved position had not served",
                        self.dataset.root, self.phases[-1].seq_len, self.seq_len,
                        self.steps, self.epoch, self.seq_len)


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
