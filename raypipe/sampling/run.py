"""Where a training run stands and what each of its steps holds, owned in one place: the
loaders serve a run's steps and `raypipe trace` replays them.

Invariant: a `Run` (one dataset) and a `MixtureRun` (weighted sources, each a `Run` of world
size 1) are the one owner of a run's position: the cursor (epoch, seq_len phases, position,
steps taken) and the history of its shape, and for a mixture every source's position. Each
is the one place that opens a run, resumes it from a state (the fingerprint, the shuffle the
state was made with, the knob check and the re-planning after a seq_len change, each written
once here), walks its steps (every step's epoch, phases, seq_len, global rows and the rows of
each rank) and counts each epoch's drop-last tail. Steps are a pure function of what a state
records, so a run resumed at any world size continues the same global order, and `replay`
(trace) is that run resumed from a state or from a history. The loaders (raypipe.loader)
keep placement, prefetch and tensors. Cost: the epoch plans' (raypipe.sampling.epochs);
O(stages + epochs + phases) to walk any number of one dataset's steps; a mixture's steps
cost O(sources + rows) each, ~17 us a step skipped (raypipe.sampling.mixture).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import TokenDataset
from raypipe.errors import ConfigError, StateError
from raypipe.io.states import (
    STATE_VERSION,
    LoaderState,
    MixtureState,
    SourcePosition,
)
from raypipe.sampling.buffers import DescribedRows
from raypipe.sampling.epochs import PlannedDataset, PlanSpec
from raypipe.sampling.mixture import (
    MixtureSchedule,
    WeightStages,
    is_mixture_spec,
    mixture_sources,
    resumed_positions,
)
from raypipe.sampling.modes import (
    BatchFiller,
    describe_shuffle,
    get_mode,
    knob_differences,
    plan_knob_names,
    upgrade_knobs,
    waste_hints,
)
from raypipe.sampling.pack import RowPieces
from raypipe.sampling.plans import WASTE_WARNING, PackingReport, window_shards_for
from raypipe.sampling.schedule import (
    BatchSchedule,
    Cursor,
    Phase,
    Phases,
    Segment,
    batch_shape,
    phase_rows,
    phases_of_rows,
)
from raypipe.sampling.state_compat import implied_phases, read_state, steps_taken, upgraded

logger = logging.getLogger("raypipe")
DESCRIBE_STEPS = 64  # steps described together: one vectorized plan call per chunk

__all__ = ["DESCRIBE_STEPS", "MixtureRun", "MixtureStep", "Run", "StepRow", "replay"]


@dataclass(frozen=True)
class StepRow:
    """One row of one rank's batch at one step, what it holds, and the documents its pieces
    are numbered in (a mixture's: its source's)."""

    step: int
    rank: int
    row: int
    epoch: int
    segments: RowPieces
    documents: TokenDataset
    source: str | None = None


# ----- what a resume checks, written once for both kinds of run ---------------------------
def check_knobs(what: str, saved: dict[str, Any], record: dict[str, Any],
                may_change: str) -> None:
    """Refuse a state whose knobs differ from `record` (seq_len may change: the state's
    stands in for it), naming each knob with both values."""
    refused = knob_differences(saved, {**record, "seq_len": saved.get("seq_len",
                                                                      record["seq_len"])})
    if refused:
        raise StateError(f"{what} made with other knobs than these: {refused} (these cannot "
                         f"change on a resume: a state from another release, whose rows were "
                         f"cut otherwise, or other options given; {may_change} can)")


def check_dataset(saved: str, dataset: Any, source: str | None = None) -> None:
    """Refuse a state made for another dataset (or mixture source) than `dataset`."""
    if saved != dataset.fingerprint:
        named = f"mixture source {source!r} ({dataset.root})" if source else dataset.root
        raise StateError(f"{named} changed since the checkpoint (a shard or the manifest): "
                         f"the state was made for dataset {saved!r}, it is now "
                         f"{dataset.fingerprint!r}")


def planned_again(what: str, plan: Callable[[], Any]) -> None:
    """Plan the rest of an epoch after a seq_len change now: a mode that cannot is refused
    here, naming the change, not at the first batch."""
    try:
        plan()
    except ConfigError as exc:
        raise StateError(f"{what}: {exc}") from None


class Run:
    """One dataset's run for one rank: its plans (`planned`), where it stands and its
    steps. `asked`: the spec as given, before "auto" and 0 knobs were resolved (a resume
    adopts the state's where it asked nothing)."""

    def __init__(self, planned: PlannedDataset, asked: PlanSpec, rank: int = 0,
                 pad_id: int = 0, boundaries: bool | None = None):
        self.planned, self.asked, self.rank, self.pad_id = planned, asked, rank, pad_id
        mode = planned.spec.loader_mode
        self.boundaries = mode.boundaries_by_default if boundaries is None else boundaries
        self.epoch, self.position, self.steps = 0, 0, 0
        self.phases = planned.first_phases  # the current epoch's seq_len phases
        self.history: list[list[int]] = []  # [step, global batch, seq_len] at each change
        # the last epoch that ended: (epoch, observations, tokens) its drop-last tail left
        self.dropped_tail: tuple[int, int, int] | None = None
        self._warned = False

    @classmethod
    def open(cls, path: str | Path, spec: PlanSpec, world_size: int,
             batch_size: int | None = None, *, rank: int = 0, format_name: str | None = None,
             cache_dir: str | Path | None = None, cache_bytes: int | str | None = None,
             batch_schedule: Any = None, seq_len_schedule: Any = None, pad_id: int = 0,
             boundaries: bool | None = None) -> Run:
        planned = PlannedDataset.open(path, spec, world_size, batch_size, format_name,
                                      cache_dir, cache_bytes,
                                      batch_schedule=list(batch_schedule or []),
                                      seq_len_schedule=list(seq_len_schedule or []))
        return cls(planned, spec, rank, pad_id, boundaries)

    @property
    def dataset(self) -> Any:
        return self.planned.dataset

    @property
    def spec(self) -> PlanSpec:
        return self.planned.spec

    @property
    def world_size(self) -> int:
        return self.planned.world_size

    @property
    def batch_size(self) -> int:
        return self.planned.batch_size

    @property
    def global_batch(self) -> int:
        """Observations consumed by the next global step (the schedule's, at its step)."""
        return self.planned.schedule.at(self.steps)

    @property
    def seq_len(self) -> int:
        """T of the next step's rows (the schedule's, at its step)."""
        return self.planned.schedule.seq_len_at(self.steps) or self.spec.seq_len

    def cursor(self) -> Cursor:
        return Cursor(self.epoch, self.position, self.steps, self.phases)

    # ----- plans ------------------------------------------------------------------------
    def plan(self, epoch: int | None = None) -> Any:
        """Epoch `epoch`'s plan (the current epoch: under its phases, the rest of it),
        checked to hold a global step; rank 0 warns once if its rows waste much."""
        epoch = self.epoch if epoch is None else epoch
        plan = self.planned.plan(epoch, self.phases if epoch == self.epoch
                                 else self.planned.first_phases)
        if plan.size < self.global_batch and len(self.phases) == 1:
            raise ConfigError(
                f"{self.dataset.root}: epoch {epoch} has {plan.size} observations, fewer "
                f"than one global step (world_size {self.world_size} x batch_size "
                f"{self.planned.observations_per_step}): every rank would get no batch")
        if not self._warned and self.rank == 0:
            spec = self.spec
            self._warned = plan.report().warn_if_wasteful(
                f"{self.dataset.root} (mode={spec.mode!r}"
                + (f", packing={spec.packing!r}" if spec.packed else "")
                + (f", overlong={spec.resolved_overlong!r}"
                   if spec.packed and spec.resolved_overlong != "cut" else "")
                + f", seq_len={self.seq_len}) epoch {epoch}",
                waste_hints(spec.mode, spec.packing, self.dataset.has_loss_mask))
        return plan

    def filler(self, epoch: int, phases: Phases = ()) -> BatchFiller:
        """The filler of epoch `epoch`'s rows under `phases` (none: the epoch's plan,
        checked as `plan` checks it)."""
        if not phases:
            self.plan(epoch)
        return self.planned.filler(epoch, self.pad_id, self.boundaries, phases)

    def prepare_epoch(self, epoch: int) -> threading.Thread:
        """Build epoch `epoch`'s plan on a background thread into the node's plan cache, so
        the epoch boundary loads it (bestfit: its block sums) instead of computing it."""
        first_phase = (Phase(self.seq_len),)

        def build() -> None:
            try:
                self.planned.plans.build(epoch, first_phase).report()
            except Exception as exc:  # noqa: BLE001  (the boundary computes it again)
                logger.warning("preparing epoch %d's plan in the background failed (%s); "
                               "the epoch boundary will build it", epoch, exc)

        thread = threading.Thread(target=build, name=f"raypipe-plan-{epoch}", daemon=True)
        thread.start()
        return thread

    def report(self, epoch: int | None = None) -> PackingReport:
        """What the epoch's rows make of the data (chat data: with its loss mask's count)."""
        report = self.plan(epoch).report()
        trained = getattr(self.dataset.manifest.totals, "trained_tokens", None)
        if trained is None:
            return report
        lengths = (chunk for _, chunk in self.planned.document_lengths().chunks())
        return report.with_loss_mask(trained, lengths, self.spec.packing, self.seq_len,
                                     self.spec.resolved_overlong)

    # ----- steps ------------------------------------------------------------------------
    def epoch_segments(self) -> Iterator[Segment]:
        """The rest of the current epoch's steps, as runs of one global batch and seq_len,
        each recorded in the history where the shape changes."""
        for segment in list(self.planned.segments(self.cursor(), one_epoch=True)):
            shape = [segment.global_batch, segment.seq_len]
            if not self.history or self.history[-1][1:] != shape:
                self.history.append([segment.step, *shape])
            yield segment

    def steps_left(self) -> int:
        """Steps left in the current epoch (under the schedule)."""
        return sum(segment.steps for segment in
                   self.planned.segments(self.cursor(), one_epoch=True))

    def rank_chunks(self, segment: Segment) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """This rank's positions [steps, k] of the segment's steps, DESCRIBE_STEPS steps a
        chunk (the first chunk one step, so the first batch waits for one step's
        description), each with the next chunk's (None after the last); halfway through the
        epoch, the next epoch's plan starts building in the background."""
        offsets = self.planned.rank_positions(0, self.rank, segment.global_batch)[0]
        steps = segment.steps
        half = self.planned.plan_size(segment.epoch, segment.phases) // 2
        bounds = sorted({0, min(1, steps), *range(DESCRIBE_STEPS, steps, DESCRIBE_STEPS),
                         steps})

        def chunk(index: int) -> np.ndarray:
            steps_here = np.arange(bounds[index], bounds[index + 1], dtype=np.int64)
            return segment.position + steps_here[:, None] * segment.global_batch + offsets

        for index in range(len(bounds) - 1):
            if (segment.step_start(bounds[index]) <= half < segment.step_start(bounds[index + 1])
                    and self.spec.loader_mode.prepares_next_epoch(self.spec)):
                self.prepare_epoch(segment.epoch + 1)
            yield chunk(index), chunk(index + 1) if index + 2 < len(bounds) else None

    def took(self, segment: Segment, step: int) -> None:
        """Global step `step` of `segment` was served: the run stands after it."""
        self.position = segment.step_start(step - segment.step + 1)
        self.steps, self.phases = step + 1, segment.phases

    def end_epoch(self) -> None:
        """The epoch ended: count (rank 0: log) its drop-last tail, then stand at the next
        epoch's start, at the seq_len the last phase had."""
        rows, tokens = self.planned.left_at(self.epoch, self.phases, self.position)
        self.dropped_tail = (self.epoch, rows, tokens)
        if rows and self.rank == 0:
            total = self.planned.epoch_tokens() if tokens else 0
            share = tokens / total if total else 0.0
            log = logger.warning if share > WASTE_WARNING else logger.info
            log("%s: epoch %d ends with %d observations (%d tokens, %.1f%% of the epoch's) "
                "under one global step left untrained (drop-last)%s", self.dataset.root,
                self.epoch, rows, tokens, 100 * share, "; hint: a smaller global batch, or a "
                "longer epoch (more data), leaves less" if share > WASTE_WARNING else "")
        self.epoch, self.position = self.epoch + 1, 0
        self.phases = (Phase(self.phases[-1].seq_len),)

    def step_rows(self, step: int, steps: int, ranks: Any) -> Iterator[StepRow]:
        """What each row of `ranks` holds in `steps` steps from `step` steps after where
        the run stands (`raypipe trace`)."""
        cursor = self.planned.schedule.walk(self.planned.plan_size, self.cursor(), step)
        taken = 0
        for segment in self.planned.segments(cursor):
            filler = self.planned.filler(segment.epoch, phases=segment.phases)
            for index in range(segment.steps):
                if taken == steps:
                    return
                for rank in ranks:
                    positions = self.planned.rank_positions(segment.step_start(index), rank,
                                                            segment.global_batch)
                    for row, pieces in enumerate(filler.segments(positions)):
                        yield StepRow(segment.step + index, rank, row, segment.epoch, pieces,
                                      self.planned.document_dataset)
                taken += 1

    # ----- state ------------------------------------------------------------------------
    def knobs(self) -> dict[str, Any]:
        """The knobs that shape the observations (seq_len: the current phase's)."""
        return self.planned.plans.at_seq_len(self.phases[-1].seq_len).knobs_record()

    def state(self) -> LoaderState:
        return LoaderState(STATE_VERSION, self.dataset.fingerprint, self.dataset.format_name,
                           self.knobs(), self.epoch, self.position,
                           {"world_size": self.world_size, "batch_size": self.batch_size},
                           self.steps, phase_rows(self.phases) if len(self.phases) > 1
                           else None, [list(entry) for entry in self.history] or None)

    def resume(self, state: dict[str, Any] | LoaderState) -> None:
        """Stand where `state` (any rank's, any world size) stands."""
        saved = (state if isinstance(state, LoaderState)
                 else LoaderState.from_dict(upgraded(state)))
        check_dataset(saved.dataset, self.dataset)
        self.adopt_shuffle(saved.knobs)
        check_knobs("the loader state", saved.knobs, self.spec.knobs_record(),
                    "seq_len, batch size, world size and a schedule")
        phases = phases_of_rows(saved.phases, saved.knobs.get("seq_len", self.spec.seq_len))
        size = self.planned.plan_size(saved.epoch, phases)
        if saved.position > size:
            raise StateError(f"loader state position {saved.position} outside epoch "
                             f"{saved.epoch} (size {size})")
        self.epoch, self.position, self.phases = saved.epoch, saved.position, phases
        self.steps = steps_taken(saved, lambda: self.planned.schedule.steps_before(
            self.planned.plan_size, saved.epoch, saved.position, phases))
        self.history = [list(entry) for entry in saved.history or []]
        if self.seq_len != self.phases[-1].seq_len:
            cursor = self.planned.schedule.phases_at(self.cursor())
            planned_again("loader state", lambda: self.planned.plan(cursor.epoch,
                                                                    cursor.phases))
            if self.rank == 0:
                logger.info("%s: seq_len %d -> %d from step %d: the rest of epoch %d is "
                            "planned again at %d from what the saved position had not "
                            "served", self.dataset.root, self.phases[-1].seq_len,
                            self.seq_len, self.steps, self.epoch, self.seq_len)

    def adopt_shuffle(self, saved_knobs: dict[str, Any]) -> None:
        """A run asked for shuffle "auto" resumes under the shuffle its state was made with
        (a state from before the knob: global), and one asked for window_shards or lanes 0
        under the state's; a value given must match instead (checked with the knobs)."""
        knobs, asked = upgrade_knobs(saved_knobs), self.asked
        self.use_shuffle(knobs["shuffle"] if asked.shuffle == "auto" else self.spec.shuffle,
                         knobs.get("window_shards", 0) if asked.window_shards == 0
                         else self.spec.window_shards,
                         knobs.get("lanes", 0) if asked.lanes == 0 else self.spec.lanes,
                         "as the loader state was made")

    def use_shuffle(self, shuffle: str, window_shards: int, lanes: int, why: str) -> None:
        """Plan under `shuffle` (its window and lanes) instead of what "auto" resolved to."""
        spec = self.spec
        if (shuffle, window_shards, lanes) == (spec.shuffle, spec.window_shards, spec.lanes):
            return
        resolved = describe_shuffle(spec, self.dataset.num_shards)
        self.planned = PlannedDataset(
            self.dataset, replace(spec, shuffle=shuffle, window_shards=window_shards,
                                  lanes=lanes), self.world_size, self.batch_size,
            self.planned.cache_dir, schedule=self.planned.schedule)
        if self.rank == 0:
            logger.info("%s: shuffle %s, %s (auto resolved it to %s)", self.dataset.root,
                        describe_shuffle(self.spec, self.dataset.num_shards), why, resolved)

    def note_shuffle(self) -> None:
        """Say which shuffle reads the bucket, and warn when the node cache is smaller than
        what it holds: the windows of this node's ranks (LOCAL_WORLD_SIZE, as torchrun and
        Ray Train set it; two a rank: the one read and the next) and every index file."""
        dataset, spec = self.dataset, self.spec
        logger.info("%s: shuffle %s", dataset.root, describe_shuffle(spec, dataset.num_shards))
        shard_bytes = [sum(entry.bytes for entry in shard.files) for shard in dataset.shards]
        budget = dataset.cache.budget_bytes
        if spec.shuffle != "windowed" or not shard_bytes:
            if (spec.shuffle == "global" and spec.loader_mode.windowed
                    and sum(shard_bytes) > budget):
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
        if needed > budget:
            logger.warning("%s: the node cache (%s bytes) is smaller than what the windowed "
                           "shuffle holds (%s bytes: %d rank(s) x 2 windows of %d shard(s), "
                           "and the index files), so shards will be fetched again; raise "
                           "cache_bytes or give a smaller window_shards (docs/cluster.md)",
                           dataset.root, f"{budget:,}", f"{needed:,}", ranks, window)


@dataclass
class MixtureStep:
    """One global step for one rank: per batch row (source index, epoch, position), the
    sources' positions after the whole step, per row the seq_len phases of its source's
    epoch plan, and per (source, epoch, phases) the rows it fills with their description."""

    step: int
    rows: list[tuple[int, int, int]]
    after: dict[str, SourcePosition]
    phases: list[Phases]
    groups: dict[tuple[int, int, Phases], tuple[list[int], DescribedRows]] = field(
        default_factory=dict)


class MixtureRun:
    """A mixture's run for one rank: its sources (`Run`s of world size 1, sorted by name),
    weights by stage, global rows and seq_len by step, and every source's position."""

    def __init__(self, names: list[str], sources: list[Run], world_size: int,
                 batches: BatchSchedule, stages: WeightStages, rank: int = 0):
        self.names, self.sources, self.world_size = names, sources, world_size
        self.batches, self.stages, self.rank = batches, stages, rank
        self.steps = 0
        self.positions = {name: SourcePosition(source.dataset.fingerprint, 0, 0, 0)
                          for name, source in zip(names, sources, strict=True)}
        self._fillers: dict[tuple[int, int, Phases], BatchFiller] = {}

    @classmethod
    def open(cls, paths: dict[str, str | Path], spec: PlanSpec, world_size: int,
             batch_size: int | None, *, weights: dict[str, float] | None = None,
             stages: list[tuple[int, dict[str, float]]] | None = None, rank: int = 0,
             batch_schedule: Any = None, seq_len_schedule: Any = None,
             **source_options: Any) -> MixtureRun:
        """`paths`: {source name: dataset}; `weights` (None: by tokens) then `stages`;
        `source_options`: Run.open's (format_name, cache_dir, ...), every source's."""
        if not paths:
            raise ConfigError("mixture: no sources given")
        if not spec.loader_mode.mixes:
            raise ConfigError(f"mixture: sources are read as documents or windows; mode "
                              f"{spec.mode!r} (pre-formed batches) cannot be mixed")
        scheduled, batch_size = batch_shape(batch_size, batch_schedule, world_size)
        names = sorted(paths)
        sources = [Run.open(paths[name], spec, 1, batch_size, **source_options)
                   for name in names]
        if spec.shuffle == "auto" and len({source.spec.shuffle for source in sources}) > 1:
            for source in sources:  # one shuffle for all: a state records one set of knobs
                source.use_shuffle("windowed", spec.window_shards, spec.lanes,
                                   "as another source of the mixture is on object storage")
        check_tokenizers(names, sources)
        batches = (scheduled or BatchSchedule.constant(world_size * sources[0].batch_size)
                   ).with_seq_lens(list(seq_len_schedule or [])
                                   or [(0, sources[0].spec.seq_len)])
        tokens = {name: source.dataset.num_tokens
                  for name, source in zip(names, sources, strict=True)}
        return cls(names, sources, world_size, batches,
                   WeightStages.of(names, weights, tokens, stages or []), rank)

    @property
    def seq_len(self) -> int:
        return self.batches.seq_len_at(self.steps) or self.sources[0].spec.seq_len

    @property
    def weights(self) -> np.ndarray:
        """The weights in force (those of the last step taken; before any, the first's)."""
        return self.stages.in_force(self.steps)

    @property
    def weights_by_name(self) -> dict[str, float]:
        return dict(zip(self.names, self.weights.tolist(), strict=True))

    def schedule(self) -> MixtureSchedule:
        """The schedule of the steps from where the mixture stands."""
        return MixtureSchedule(
            self.stages, self.world_size, self.batches,
            [source.planned.plan_size for source in self.sources],
            [self.positions[name] for name in self.names], self.steps,
            self.sources[0].spec.seq_len)

    def filler(self, source: int, epoch: int, phases: Phases) -> BatchFiller:
        """Source `source`'s filler of epoch `epoch` under `phases` (the latest few kept)."""
        key = (source, epoch, phases)
        if key not in self._fillers:
            if len(self._fillers) > 4 * len(self.sources):
                self._fillers.clear()
            self._fillers[key] = self.sources[source].filler(epoch, phases)
        return self._fillers[key]

    # ----- steps ------------------------------------------------------------------------
    def rank_steps(self, until: int | None) -> Iterator[MixtureStep]:
        """This rank's steps to `until` (None: without end), described DESCRIBE_STEPS at a
        time (one describe per source, epoch and phases)."""
        schedule = self.schedule()

        def steps() -> Iterator[MixtureStep]:
            while until is None or schedule.step < until:
                step = schedule.step
                slots = [slot for slot in schedule.next_step() if slot.rank == self.rank]
                yield MixtureStep(step, [(slot.source, slot.epoch, slot.position)
                                         for slot in slots],
                                  dict(zip(self.names, schedule.positions, strict=True)),
                                  [slot.phases for slot in slots])

        walk = steps()
        while chunk := list(itertools.islice(walk, DESCRIBE_STEPS)):
            self._describe(chunk)
            yield from chunk

    def _describe(self, chunk: list[MixtureStep]) -> None:
        wanted: dict[tuple[int, int, Phases], list[tuple[int, int, int]]] = {}
        for index, job in enumerate(chunk):
            for row, (source, epoch, position) in enumerate(job.rows):
                wanted.setdefault((source, epoch, job.phases[row]), []).append(
                    (index, row, position))
        for key, entries in wanted.items():
            positions = np.array([[position for _, _, position in entries]], dtype=np.int64)
            plan = self.filler(*key).describe(positions)[0]
            by_step: dict[int, list[int]] = {}
            for at, (index, _, _) in enumerate(entries):
                by_step.setdefault(index, []).append(at)
            for index, ats in by_step.items():
                chunk[index].groups[key] = ([entries[at][1] for at in ats], DescribedRows(
                    plan.positions[ats], plan.observation_ids[ats],
                    [plan.rows[at] for at in ats]))

    def took(self, step: int, after: dict[str, SourcePosition]) -> None:
        """Global step `step` was served: the sources stand at `after`."""
        self.positions, self.steps = after, step + 1

    def step_rows(self, step: int, steps: int, ranks: Any) -> Iterator[StepRow]:
        """What each row of `ranks` holds in `steps` steps from `step` steps after where
        the mixture stands (`raypipe trace`: counts alone up to there)."""
        schedule = self.schedule()
        schedule.skip(step)
        for _ in range(steps):
            number = schedule.step
            for slot in schedule.next_step():
                if slot.rank in ranks:
                    pieces = self.filler(slot.source, slot.epoch, slot.phases).segments(
                        np.array([[slot.position]]))[0]
                    yield StepRow(number, slot.rank, slot.row, slot.epoch, pieces,
                                  self.sources[slot.source].planned.document_dataset,
                                  self.names[slot.source])

    # ----- state ------------------------------------------------------------------------
    def knobs(self) -> dict[str, Any]:
        """The knobs that shape every source's observations (seq_len: the next step's)."""
        return self.sources[0].planned.plans.at_seq_len(self.seq_len).knobs_record()

    def state(self) -> MixtureState:
        return MixtureState(self.weights_by_name, self.knobs(), self.steps,
                            dict(self.positions))

    def resume(self, state: dict[str, Any] | MixtureState) -> None:
        """Stand where `state` (any rank's, any world size) stands; weights other than the
        state's begin a stage there, every source continuing from its own position."""
        saved = (state if isinstance(state, MixtureState)
                 else MixtureState.from_dict(upgraded(state)))
        if sorted(saved.sources) != self.names:
            raise StateError(f"mixture state holds sources {sorted(saved.sources)}, this "
                             f"mixture has {self.names}")
        for name, source in zip(self.names, self.sources, strict=True):
            check_dataset(saved.sources[name].dataset, source.dataset, name)
            source.adopt_shuffle(saved.knobs)
        check_knobs("the mixture state", saved.knobs, self.knobs(),
                    "seq_len, batch size, world size and weights")
        self.steps = saved.steps
        if not np.allclose([saved.weights[name] for name in self.names], self.weights,
                           rtol=0, atol=1e-12):
            logger.info("mixture weights changed on resume: %s -> %s; every source continues "
                        "from its own position, the new weights' shares counted from here",
                        saved.weights, self.weights_by_name)
        implied = implied_phases(saved.knobs.get("seq_len", self.seq_len),
                                 self.sources[0].spec.seq_len)
        positions = resumed_positions(
            self.stages, np.array([saved.weights[name] for name in self.names]), saved.steps,
            [replace(saved.sources[name], phases=saved.sources[name].phases or implied)
             for name in self.names])
        self.positions = dict(zip(self.names, positions, strict=True))
        schedule = self.schedule()

        def rephased() -> None:
            schedule.rephase()
            for index, position in enumerate(schedule.positions):
                self.sources[index].planned.plan(position.epoch, schedule.phases_of(position))

        planned_again("mixture state", rephased)


def check_tokenizers(names: list[str], sources: list[Run]) -> None:
    """Sources share one tokenizer (the same sha256), or the mixture is refused naming
    both."""
    first = sources[0].dataset.manifest.tokenizer
    for name, source in zip(names[1:], sources[1:], strict=True):
        other = source.dataset.manifest.tokenizer
        if other.sha256 != first.sha256:
            raise ConfigError(f"mixture: sources {names[0]!r} ({first.spec}, sha256 "
                              f"{first.sha256[:12]}) and {name!r} ({other.spec}, sha256 "
                              f"{other.sha256[:12]}) use different tokenizers")


# ----- a run replayed (`raypipe trace`) ----------------------------------------------------
def replay(data: str | Path | dict[str, str], *,
           state: dict[str, Any] | str | Path | None = None,
           history: dict[str, Any] | str | Path | None = None, world_size: int | None = None,
           seq_len: int | None = None, batch_size: int | None = None,
           batch_schedule: list[tuple[int, int]] | None = None,
           seq_len_schedule: list[tuple[int, int]] | None = None,
           weights: dict[str, float] | None = None,
           stages: list[tuple[int, dict[str, float]]] | None = None,
           format_name: str | None = None, cache_dir: str | Path | None = None,
           **knobs: Any) -> Run | MixtureRun:
    """The run of `data` (a dataset, a mixture YAML or {name: path}) under the knobs given,
    resumed where `state` (a state_dict or its JSON file) stands, its knobs, world size
    and global batch taken from it where not given; or, from a `history` state, the run
    from its start under the shape its record of changes gives."""
    if history is not None:
        if state is not None or batch_schedule or seq_len_schedule:
            raise ConfigError("trace: give history (a state whose record of changes gives "
                              "the schedules) or state and the schedules, not both")
        recorded = read_state_file(history)
        if not isinstance(recorded, LoaderState) or not recorded.history:
            raise ConfigError(f"trace: {history if not isinstance(history, dict) else 'the'}"
                              " state records no history of changes (a one-dataset loader's "
                              "state does)")
        knobs = {**state_knobs(recorded, knobs.get("mode")), **knobs}
        world_size = world_size or recorded.saved_with.get("world_size")
        batch_schedule = [(entry[0], entry[1]) for entry in recorded.history]
        seq_len_schedule = [(entry[0], entry[2]) for entry in recorded.history]
    saved = read_state_file(state)
    if saved is not None:
        knobs = {**state_knobs(saved, knobs.get("mode")), **knobs}
        seq_len = seq_len or saved.knobs.get("seq_len")
        if isinstance(saved, LoaderState):
            world_size = world_size or saved.saved_with.get("world_size")
            if batch_size is None and not batch_schedule:
                batch_schedule = saved_batch_schedule(saved)
            batch_size = batch_size or saved.saved_with.get("batch_size")
    spec = PlanSpec.of(seq_len=(seq_len_schedule[0][1] if seq_len_schedule else seq_len) or 0,
                       **knobs)
    world_size = world_size or 1
    run: Run | MixtureRun
    if isinstance(data, dict) or is_mixture_spec(data):
        if isinstance(saved, LoaderState):
            raise ConfigError("a single dataset's loader state cannot trace a mixture")
        if batch_size is None and not batch_schedule:
            raise ConfigError("tracing a mixture needs batch_size or batch_schedule (its "
                              "state does not record them)")
        paths, weights, stages = mixture_sources(data, weights, stages)
        if saved is not None and weights is None and not stages:
            weights = saved.weights
        run = MixtureRun.open(paths, spec, world_size,
                              None if batch_schedule else batch_size, weights=weights,
                              stages=stages, batch_schedule=batch_schedule,
                              seq_len_schedule=seq_len_schedule, cache_dir=cache_dir)
    else:
        if isinstance(saved, MixtureState):
            raise ConfigError("a mixture state needs the mixture (a YAML or {name: path}) "
                              "as data")
        run = Run.open(data, spec, world_size, None if batch_schedule else batch_size,
                       format_name=format_name, cache_dir=cache_dir,
                       batch_schedule=batch_schedule, seq_len_schedule=seq_len_schedule)
    if saved is not None:
        run.resume(saved)  # type: ignore[arg-type]  (each kind checked above)
    return run


def state_knobs(saved: LoaderState | MixtureState, mode: str | None) -> dict[str, Any]:
    """The plan knobs a state ran with but seq_len (a knob it leaves out at its value from
    before it existed), those of `mode` where another mode is asked for."""
    stated = upgrade_knobs(saved.knobs)
    names = set(plan_knob_names(mode or stated.get("mode", PlanSpec.mode))) - {"seq_len"}
    return {name: value for name, value in stated.items() if name in names}


def saved_batch_schedule(saved: LoaderState) -> list[tuple[int, int]] | None:
    """The global batch by step of the run that saved `saved`: its history's (a ramp
    included), or its one global batch (the saving rank's batch times its world size), so
    a replay at another world size splits the run's global batch as a resumed loader does.
    None for a mode that takes no schedule (a step is one pre-formed batch a rank)."""
    if not get_mode(upgrade_knobs(saved.knobs)["mode"]).schedules:
        return None
    if saved.history:
        return [(entry[0], entry[1]) for entry in saved.history]
    per_rank, world = saved.saved_with.get("batch_size"), saved.saved_with.get("world_size")
    return [(0, per_rank * world)] if per_rank and world else None


def read_state_file(state: dict[str, Any] | str | Path | None
                    ) -> LoaderState | MixtureState | None:
    """A loader's or a mixture's state, from its dict or its JSON file."""
    if state is None or isinstance(state, dict):
        return read_state(state)
    try:
        return read_state(json.loads(Path(state).read_text()))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{state}: cannot read the loader state: {exc}") from exc
