"""Where a training run stands and what each of its steps holds, owned in one place: the
loaders serve a run's steps and `raypipe trace` replays them.

Invariant: a `Run` is the one owner of where one dataset's run stands: the cursor (epoch,
seq_len phases, position, steps taken) and the history of its shape; what changes its data
(the documents it excludes and the units it gained, each from its step: on a resume, or
while following a running job) is its collaborator `data_changes`
(raypipe.sampling.data_changes). It is the one place
that opens a run, resumes it from a state, walks its steps (every step's epoch, phases,
seq_len, global rows and the rows of each rank) and counts each epoch's drop-last tail. What
a resume checks (the fingerprint, the shuffle the state was made with, the knobs, the
re-planning after a seq_len change) is written once here, for this run and a mixture's
(raypipe.sampling.mixture_run); `raypipe trace` is the run resumed from a state or a history
(raypipe.sampling.replay). Steps are a pure function of what a state records, so a run
resumed at any world size continues the same global order. The loaders (raypipe.loader)
keep placement, prefetch and tensors. Cost: the epoch plans' (raypipe.sampling.epochs);
O(stages + epochs + phases) to walk any number of steps.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from raypipe.dataset import BatchDataset, TokenDataset
from raypipe.errors import ConfigError, StateError
from raypipe.io.states import (
    STATE_VERSION,
    LoaderState,
)
from raypipe.sampling.blocks import WHOLE_SHARDS, WINDOWS_HELD, WindowBudget, WindowLayout
from raypipe.sampling.data_changes import DataChanges, planned_again
from raypipe.sampling.epochs import PlannedDataset, PlanSpec
from raypipe.sampling.modes import (
    BatchFiller,
    EpochPlan,
    describe_shuffle,
    knob_differences,
    waste_hints,
    windowed_modes,
)
from raypipe.sampling.pack import RowPieces
from raypipe.sampling.plans import WASTE_WARNING, PackingReport, window_blocks_for
from raypipe.sampling.resolve import as_asked, resolve
from raypipe.sampling.schedule import (
    Cursor,
    Phase,
    Phases,
    Segment,
    phase_rows,
    phases_of_rows,
)
from raypipe.sampling.state_compat import steps_taken, upgrade_knobs, upgraded

logger = logging.getLogger("raypipe")
SMALL_WINDOW_ROWS = 50  # windows under this many rows pad their last rows visibly
DESCRIBE_STEPS = 64  # steps described together: one vectorized plan call per chunk

__all__ = ["DESCRIBE_STEPS", "Run", "StepRow"]


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


class Run:
    """One dataset's run for one rank: its plans (`planned`), where it stands and its
    steps. `asked`: the spec as given, before "auto" and 0 knobs were resolved (a resume
    adopts the state's where it asked nothing)."""

    def __init__(self, planned: PlannedDataset, asked: PlanSpec, rank: int = 0,
                 pad_id: int = 0, boundaries: bool | None = None, units_join: str = "epoch"):
        self.planned, self.rank, self.pad_id = planned, rank, pad_id
        # the spec with the data's knobs decided, its shuffle and layout as given
        self.asked = as_asked(planned.spec, asked)
        self.units_join = units_join  # where added units are served (LoaderOptions)
        mode = planned.spec.loader_mode
        self.boundaries = mode.boundaries_by_default if boundaries is None else boundaries
        # where the run stands: the next step, its epoch, position and seq_len phases
        self.at = Cursor(0, 0, 0, planned.first_phases)
        self.history: list[list[int]] = []  # [step, global batch, seq_len] at each change
        # the last epoch that ended: (epoch, observations, tokens) its drop-last tail left
        self.dropped_tail: tuple[int, int, int] | None = None
        self._warned = False
        self._told_tail = False  # rank 0 warned of a drop-last tail once (later: INFO)
        self._window_blocks: tuple[PlanSpec, Any, int] | None = None  # (spec, plans, blocks)
        # its data, and what changes it: units joining, exclusions, refusals
        self.data_changes = DataChanges(self)

    @classmethod
    def open(cls, path: str | Path, spec: PlanSpec, world_size: int,
             batch_size: int | None = None, *, rank: int = 0, format_name: str | None = None,
             cache_dir: str | Path | None = None, cache_bytes: int | str | None = None,
             batch_schedule: Any = None, seq_len_schedule: Any = None, pad_id: int = 0,
             boundaries: bool | None = None, units_join: str = "epoch",
             manifest: Any = None, budget_sources: int = 1,
             node_ranks: int | None = None) -> Run:
        planned = PlannedDataset.open(path, spec, world_size, batch_size, format_name,
                                      cache_dir, cache_bytes,
                                      batch_schedule=list(batch_schedule or []),
                                      seq_len_schedule=list(seq_len_schedule or []),
                                      manifest=manifest, budget_sources=budget_sources,
                                      node_ranks=node_ranks)
        return cls(planned, spec, rank, pad_id, boundaries, units_join)

    @property
    def dataset(self) -> TokenDataset | BatchDataset:
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
        return self.at

    @property
    def epoch(self) -> int:
        return self.at.epoch

    @property
    def position(self) -> int:
        """Observations of the current epoch's plan (its last phase's) consumed."""
        return self.at.position

    @property
    def steps(self) -> int:
        """Global steps taken from the start of training."""
        return self.at.step

    @property
    def phases(self) -> Phases:
        """The current epoch's seq_len phases."""
        return self.at.phases

    # ----- plans ------------------------------------------------------------------------
    def plan(self, epoch: int | None = None) -> EpochPlan:
        """Epoch `epoch`'s plan (the current epoch: under its phases, the rest of it),
        checked to hold a global step; rank 0 warns once if its rows waste much."""
        epoch = self.epoch if epoch is None else epoch
        plan = self.planned.plan(epoch, self.phases if epoch == self.epoch
                                 else self.later_phases())
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
                self._window_padding(waste_hints(spec.mode, spec.packing,
                                                 self.dataset.has_loss_mask)))
        return plan

    def _window_padding(self, hint: Callable[[str], str]) -> Callable[[str], str]:
        """`hint`, but padding under windows of blocks that hold under SMALL_WINDOW_ROWS
        rows is said to come from them: each window is packed on its own and pads its last
        rows, so a larger cache (larger windows) pads less, not shorter rows. Worked out
        only when a padding warning asks for it."""
        spec = self.spec
        if spec.shuffle != "windowed" or spec.block_bytes >= WHOLE_SHARDS:
            return hint

        def said(waste: str) -> str:
            if waste != "padding":
                return hint(waste)
            window = self.window_blocks
            tokens = window * spec.block_bytes // self.dataset.block_itemsize
            if tokens >= SMALL_WINDOW_ROWS * (self.seq_len + 1):
                return hint(waste)
            return (f"each window of the windowed shuffle ({window} block(s) of "
                    f"{spec.block_bytes:,} bytes, ~{tokens:,} tokens) is packed on its own "
                    "and pads its last rows: a larger cache_bytes makes larger windows")

        return said

    @property
    def window_blocks(self) -> int:
        """Blocks a window of its windowed shuffle holds (its plan's blocks; worked out once
        per spec and plans: `loader.stats` asks it, and the blocks are O(blocks) to load)."""
        spec, plans = self.spec, self.planned.plans
        known = self._window_blocks
        if known is None or known[0] != spec or known[1] is not plans:
            window = window_blocks_for(len(plans.blocks()), spec.window_blocks,
                                       max(spec.lanes, 1))
            known = self._window_blocks = (spec, plans, window)
        return known[2]

    def window_layouts(self) -> list[WindowLayout]:
        """Its windowed plan of blocks read from object storage, as one WindowLayout (none
        for a local dataset, another shuffle, or windows of whole shards)."""
        spec, dataset = self.spec, self.dataset
        if (spec.shuffle != "windowed" or spec.block_bytes >= WHOLE_SHARDS
                or dataset.cache is None):
            return []
        return [WindowLayout(str(dataset.root), len(dataset.shards),
                             dataset.num_tokens * dataset.block_itemsize, spec.block_bytes,
                             self.window_blocks)]

    def filler(self, epoch: int, phases: Phases = ()) -> BatchFiller:
        """The filler of epoch `epoch`'s rows under `phases` (none: the epoch's plan,
        checked as `plan` checks it)."""
        if not phases:
            self.plan(epoch)
        return self.planned.filler(epoch, self.pad_id, self.boundaries, phases)

    def prepare_epoch(self, epoch: int) -> threading.Thread:
        """Build epoch `epoch`'s plan on a background thread into the node's plan cache, so
        the epoch boundary loads it (bestfit: its block sums) instead of computing it."""
        first_phase = self.later_phases()

        def build() -> None:
            try:
                self.planned.plans.build(epoch, first_phase).report()
            except Exception as exc:  # noqa: BLE001  (the boundary computes it again)
                logger.warning("preparing epoch %d's plan in the background failed (%s); "
                               "the epoch boundary will build it", epoch, exc)

        thread = threading.Thread(target=build, name=f"raypipe-plan-{epoch}", daemon=True)
        thread.start()
        return thread

    def later_phases(self) -> Phases:
        """The phases a later epoch begins with, as far as the run knows now: one, at the
        current seq_len, without the documents of every exclusion made."""
        return (Phase(self.seq_len, 0, len(self.planned.exclusions), len(self.planned.joins)),)

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
            shape = [segment.global_batch, segment.seq_len, self.world_size]
            if not self.history or self.history[-1][1:] != shape:
                self.history.append([segment.step, *shape])
            yield segment

    def steps_in_epoch(self, epoch: int | None = None) -> int:
        """Steps of epoch `epoch`'s plan (the current epoch: the rest of it) at the current
        global batch."""
        return self.plan(epoch).size // self.global_batch

    def rows_per_rank(self, segment: Segment) -> int:
        """The rows of this rank's batch at each of the segment's steps (pre-formed
        batches: the batch's rows, one observation holding them all)."""
        observations = segment.global_batch // self.world_size
        return self.batch_size * observations // self.planned.observations_per_step

    def steps_left(self) -> int:
        """Steps left in the current epoch (under the schedule)."""
        return sum(segment.steps for segment in
                   self.planned.segments(self.cursor(), one_epoch=True))

    def rank_chunks(self, segment: Segment) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """This rank's positions [steps, k] of the segment's steps, DESCRIBE_STEPS steps a
        chunk (the first chunk one step, so the first batch waits for one step's
        description), each with the next chunk's (None after the last); halfway through the
        epoch, the next epoch's plan starts building in the background."""
        steps = segment.steps
        half = self.planned.plan_size(segment.epoch, segment.phases) // 2
        bounds = sorted({0, min(1, steps), *range(DESCRIBE_STEPS, steps, DESCRIBE_STEPS),
                         steps})

        def chunk(index: int) -> np.ndarray:
            return self.planned.rank_steps(segment, bounds[index], bounds[index + 1],
                                           self.rank)

        following = chunk(0) if len(bounds) > 1 else None
        for index in range(len(bounds) - 1):
            if (segment.step_start(bounds[index]) <= half < segment.step_start(bounds[index + 1])
                    and self.spec.loader_mode.prepares_next_epoch(self.spec)):
                self.prepare_epoch(segment.epoch + 1)
            current, following = following, (chunk(index + 1) if index + 2 < len(bounds)
                                             else None)
            yield current, following

    def took(self, segment: Segment, step: int) -> None:
        """Global step `step` of `segment` was served: the run stands after it."""
        self.at = segment.cursor(step - segment.step + 1)

    def end_epoch(self) -> None:
        """The epoch ended: count (rank 0: log; a warning the first time and past
        WASTE_WARNING) its drop-last tail, then stand at the next epoch's start, at the
        seq_len the last phase had."""
        rows, tokens = self.planned.left_at(self.epoch, self.phases, self.position)
        self.dropped_tail = (self.epoch, rows, tokens)
        if rows and self.rank == 0:
            total = self.planned.epoch_tokens() if tokens else 0
            share = tokens / total if total else 0.0
            # seen by default: the run's first tail, and any past the waste threshold
            log = (logger.warning if share > WASTE_WARNING or not self._told_tail
                   else logger.info)
            self._told_tail = True
            log("%s: epoch %d ends with %d observations (%d tokens, %.1f%% of the epoch's) "
                "under one global step left untrained (drop-last)%s", self.dataset.root,
                self.epoch, rows, tokens, 100 * share, "; hint: a smaller global batch, or a "
                "longer epoch (more data), leaves less" if share > WASTE_WARNING else "")
        self.at = self.at.next_epoch()

    def step_rows(self, step: int, steps: int, ranks: Any,
                  world_at: Callable[[int], int] | None = None) -> Iterator[StepRow]:
        """What each row of `ranks` holds in `steps` steps from `step` steps after where
        the run stands (`raypipe trace`); `world_at(step)`: the world size that took each
        step (a history across resizes, replayed at world size 1), whose ranks of `ranks`
        (None: every one) are named."""
        cursor = self.planned.schedule.walk(self.planned.plan_size, self.cursor(), step)
        taken = 0
        for segment in self.planned.segments(cursor):
            filler = self.planned.filler(segment.epoch, phases=segment.phases)
            for index in range(segment.steps):
                if taken == steps:
                    return
                world = None if world_at is None else world_at(segment.step + index)
                for rank in (ranks if world is None else
                             [r for r in ranks or range(world) if r < world]):
                    positions = self.planned.rank_steps(segment, index, index + 1, rank,
                                                        world)
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
                           self.steps, phase_rows(self.phases)
                           if len(self.phases) > 1 or self.phases[0].excluded else None,
                           [list(entry) for entry in self.history] or None,
                           tuple(self.planned.exclusions.records) or None,
                           self.data_changes.data.view, self.data_changes.data.added or None)

    def resume(self, state: dict[str, Any] | LoaderState, grow: bool = True) -> None:
        """Stand where `state` (any rank's, any world size) stands (`grow`: the units the
        output gained since joining, as a loader's resume adds them; a replay of what the
        state recorded adds none)."""
        saved = (state if isinstance(state, LoaderState)
                 else LoaderState.from_dict(upgraded(state)))
        self.data_changes.adopt_data(saved, grow)
        self.adopt_shuffle(saved.knobs)
        check_knobs("the loader state", saved.knobs, self.spec.knobs_record(),
                    "seq_len, batch size, world size and a schedule")
        self.planned.reset_exclusions()
        for record in saved.exclusions or ():
            self.planned.adopt_exclusion(record)
        phases = phases_of_rows(saved.phases, saved.knobs.get("seq_len", self.spec.seq_len))
        size = self.planned.plan_size(saved.epoch, phases)
        if saved.position > size:
            raise StateError(f"loader state position {saved.position} outside epoch "
                             f"{saved.epoch} (size {size})")
        self.at = Cursor(saved.epoch, saved.position, steps_taken(
            saved, lambda: self.planned.schedule.steps_before(
                self.planned.plan_size, saved.epoch, saved.position, phases)), phases)
        self.history = [list(entry) for entry in saved.history or []]
        cursor = self.planned.schedule.phases_at(self.cursor())
        if cursor.phases != self.phases:  # a seq_len change, or units joining, from here
            planned_again("loader state", lambda: self.planned.plan(cursor.epoch,
                                                                    cursor.phases))
        if self.seq_len != self.phases[-1].seq_len and self.rank == 0:
            logger.info("%s: seq_len %d -> %d from step %d: the rest of epoch %d is "
                        "planned again at %d from what the saved position had not "
                        "served", self.dataset.root, self.phases[-1].seq_len,
                        self.seq_len, self.steps, self.epoch, self.seq_len)

    def adopt_shuffle(self, saved_knobs: dict[str, Any]) -> None:
        """A run asked for shuffle "auto" resumes under the shuffle its state was made with
        (a state from before the knob: global), and one asked for block_bytes,
        window_blocks or lanes 0 under the state's; a value given must match instead
        (checked with the knobs): raypipe.sampling.resolve."""
        self.use_spec(resolve(self.asked, replace(self.planned.facts,
                                                  saved=upgrade_knobs(saved_knobs))),
                      "as the loader state was made")

    def adopt_sibling(self, sibling: Run) -> None:
        """A mixture's source takes the shuffle and layout `sibling` (its first source on
        object storage) resolved: one set of knobs for the mixture's state."""
        self.use_spec(resolve(self.asked, replace(self.planned.facts, sibling=sibling.spec)),
                      f"as the mixture's source {sibling.dataset.root} resolved it")

    def use_spec(self, wanted: PlanSpec, why: str) -> None:
        """Plan under `wanted` (resolved) instead of the spec the run resolved at open."""
        spec = self.spec
        if wanted == spec:
            return
        resolved = describe_shuffle(spec)
        self.planned.adopt_spec(wanted)
        if self.rank == 0:
            logger.info("%s: shuffle %s, %s (auto resolved it to %s)", self.dataset.root,
                        describe_shuffle(self.spec), why, resolved)

    def note_shuffle(self) -> None:
        """Say which shuffle reads the bucket, and warn when the node cache is smaller than
        what it holds: the windows of this node's ranks (LOCAL_WORLD_SIZE, as torchrun and
        Ray Train set it; two a rank: the one read and the next) and every index file
        (a window sized from the budget fits it; one given, or a state's, may not)."""
        dataset, spec = self.dataset, self.spec
        logger.info("%s: shuffle %s", dataset.root, describe_shuffle(spec))
        self._note_whole_shards()
        shard_bytes = [sum(entry.bytes for entry in shard.files) for shard in dataset.shards]
        budget = dataset.cache.budget_bytes
        if spec.shuffle != "windowed" or not shard_bytes:
            if spec.shuffle == "global" and sum(shard_bytes) > budget:
                logger.warning("%s: the global shuffle reads every shard throughout the epoch "
                               "and the node cache (%s bytes) holds less than the dataset "
                               "(%s bytes), so shards are fetched many times (up to a shard "
                               "a row); %s", dataset.root, f"{budget:,}",
                               f"{sum(shard_bytes):,}", global_refetch_remedy(spec, shard_bytes,
                                                                               budget))
            return
        window = self.window_blocks
        fits = self.planned.facts.budget.for_lanes(spec.lane_ranks)
        unit = (max(shard_bytes) if spec.block_bytes >= WHOLE_SHARDS else spec.block_bytes)
        needed = fits.node_lanes * WINDOWS_HELD * window * unit + fits.index_bytes
        if needed > budget:
            logger.warning("%s: the node cache (%s bytes) is smaller than what the windowed "
                           "shuffle holds (%s bytes: %d lane(s) x %d windows of %d block(s) "
                           "of up to %s bytes, and the index files), so blocks will be "
                           "fetched again; raise cache_bytes, or give window_blocks and "
                           "block_bytes 0 (sized from the budget: docs/cluster.md)",
                           dataset.root, f"{budget:,}", f"{needed:,}", fits.node_lanes,
                           WINDOWS_HELD, window, f"{unit:,}")
        self._note_long_documents(fits)

    def _note_long_documents(self, fits: WindowBudget) -> None:
        """Warn where blocks hold more than a window can (a document longer than a window
        is a block of its own): each is read whole, the node cache over its budget while
        it is read; say how many, the longest and its shard, and the budget that holds it."""
        if self.spec.block_bytes >= WHOLE_SHARDS:
            return
        plans = self.planned.plans
        sizes = plans.block_sizes()
        over = np.flatnonzero(sizes > fits.window_bytes)
        if not over.size:
            return
        longest = int(over[np.argmax(sizes[over])])
        shard = self.dataset.shards[int(plans.blocks().shards[longest])]
        holds = min(fits.least_budget(int(sizes[longest])), fits.dataset_bytes * fits.sources)
        logger.warning("%s: %d block(s) hold more than a window (%s bytes under cache_bytes "
                       "%s for %d rank(s)): a document longer than a window is a block of "
                       "its own, read whole, and the node cache passes its budget while it "
                       "is read; the largest, %s bytes, is in shard %s; cache_bytes >= %s "
                       "holds it (in a window, or the whole dataset)", self.dataset.root,
                       over.size, f"{fits.window_bytes:,}", f"{fits.budget_bytes:,}",
                       fits.node_ranks, f"{int(sizes[longest]):,}", shard.name, f"{holds:,}")

    def _note_whole_shards(self) -> None:
        """Warn where a windowed shuffle of a bucket dataset's documents fetches whole
        shards because some of them cannot be read a block at a time (older outputs)."""
        spec = self.spec
        if spec.shuffle == "windowed" and spec.block_bytes >= WHOLE_SHARDS:
            note = self.dataset.whole_shards_note()
            if note is not None:
                logger.warning("%s", note)


def global_refetch_remedy(spec: PlanSpec, shard_bytes: list[int], budget: int) -> str:
    """What fetches each shard once an epoch where the global shuffle would fetch them
    again and again: the windowed shuffle where the mode serves it, else shard-local groups
    that fit the budget (the group read and the next), else a cache of the whole dataset."""
    whole = f"or cache_bytes of at least {sum(shard_bytes):,}"
    if spec.loader_mode.windowed:
        return f"shuffle='auto' (windowed) fetches each block once, {whole}"
    if spec.loader_mode.shard_local:
        group = WindowBudget(budget, largest_shard_bytes=max(shard_bytes)).shard_group()
        return (f"shuffle='auto' (shard-local groups sized from the cache) or "
                f"shuffle='shard_local' with group_shards={group} fetches each shard once "
                f"(a step then mixes {group} neighbouring shard(s)), {whole}, or a mode "
                f"that serves the windowed shuffle ({', '.join(windowed_modes())})")
    return f"give cache_bytes of at least {sum(shard_bytes):,}"
