"""Global batch size and seq_len by step, and the one walk of a loader's steps under them.

Invariant: the global batch of global step s (observations every rank takes together) and
its seq_len are pure functions of the schedule and s: stage k's value from its first step
to the next stage's (a ramp is a run of stages, as Megatron's --rampup-batch-size and
OLMo-core's batch-size scheduler make; a long-context phase is a seq_len stage). An epoch's
steps take their global batch each, one after another from where the last ended, while a
whole step fits (drop-last: the tail that does not is left, counted in the epoch's report).
A seq_len that changes inside an epoch, documents excluded from a step on (the run's
exclusions: raypipe.sampling.exclusions), or units joining the epoch (raypipe.sampling.
growth) begin a `Phase`: the rest of the epoch planned again at the new seq_len, without
the excluded documents, with the joined ones, from what the phase before had not served at
that position (the mode's `continue_plan`), so no token is served twice and none is
skipped but the excluded. The cursor of any
step, (epoch, phases, position, step), is a pure function of (the schedule, the plans'
sizes, the cursor walked from); a loader state records it. `segments` yields the runs of
equal global batch and seq_len, which the loader fills and `raypipe trace` replays. Cost:
O(stages + epochs + phases) to walk any number of steps, nothing per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from raypipe.errors import ConfigError


@dataclass(frozen=True)
class Phase:
    """A stretch of an epoch at one seq_len, without the documents of the run's first
    `excluded` exclusions, with those of units its first `joined` joins added to the epoch
    in progress (raypipe.sampling.growth): the first phase is the epoch's plan; a later one
    is the rest of the phase before it, from its position `begins` on, planned again
    (observations numbered from 0 again)."""

    seq_len: int
    begins: int = 0
    excluded: int = 0
    joined: int = 0


Phases = tuple[Phase, ...]


def phase_rows(phases: Phases) -> list[list[int]]:
    """Phases as a state records them: [[seq_len, begins], ...], [seq_len, begins,
    excluded] where documents are excluded, [seq_len, begins, excluded, joined] where
    units joined the epoch."""
    return [[phase.seq_len, phase.begins,
             *([phase.excluded, phase.joined] if phase.joined else
               [phase.excluded] if phase.excluded else [])] for phase in phases]


def phases_of_rows(rows: list[list[int]] | None, seq_len: int) -> Phases:
    """The phases a state records (None: one, at `seq_len`, the state's)."""
    return tuple(Phase(*row) for row in rows) if rows else (Phase(seq_len),)


def next_epoch_phases(phases: Phases) -> Phases:
    """The phases the next epoch begins with: one, at the last phase's seq_len, exclusions
    and joins."""
    last = phases[-1]
    return (Phase(last.seq_len, 0, last.excluded, last.joined),)
PlanSize = Callable[[int, Phases], int]  # (epoch, phases) -> observations of that plan


@dataclass(frozen=True)
class Cursor:
    """Where a loader stands: global step `step` is next, at observation `position` of
    epoch `epoch`'s plan under `phases` (a loader state's epoch, phases, position, steps)."""

    epoch: int
    position: int
    step: int
    phases: Phases

    def next_epoch(self) -> Cursor:
        """The cursor at the start of the next epoch, at the same step, in the phase
        `next_epoch_phases` gives."""
        return Cursor(self.epoch + 1, 0, self.step, next_epoch_phases(self.phases))

    @property
    def begun(self) -> bool:
        """Whether its epoch has served rows: a position past the start, or a phase begun
        inside the epoch (a later phase numbers its observations from 0 again, so its
        position 0 is not the epoch's start)."""
        return self.position > 0 or len(self.phases) > 1


@dataclass(frozen=True)
class Segment:
    """`steps` consecutive steps of epoch `epoch` from observation `position` of its plan
    under `phases` and global step `step`, each of `global_batch` observations of rows of
    the last phase's seq_len."""

    epoch: int
    position: int
    step: int
    steps: int
    global_batch: int
    phases: Phases = (Phase(0),)

    @property
    def seq_len(self) -> int:
        return self.phases[-1].seq_len

    def step_start(self, index: int) -> int:
        """The first observation of the segment's `index`-th step."""
        return self.position + index * self.global_batch

    def step_at(self, position: int) -> int:
        """The global step that serves observation `position` of the segment."""
        return self.step + (position - self.position) // self.global_batch

    def cursor(self, index: int) -> Cursor:
        """The cursor before the segment's `index`-th step."""
        return Cursor(self.epoch, self.step_start(index), self.step + index, self.phases)


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size by step: `sizes[k]` observations a step from step `starts[k]`;
    seq_len by step: `seq_lens[k]` from step `seq_starts[k]` (none: the seq_len a cursor
    stands at is kept)."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    seq_starts: tuple[int, ...] = ()
    seq_lens: tuple[int, ...] = ()
    exclusion_starts: tuple[int, ...] = ()  # the step each exclusion of the run begins at
    join_starts: tuple[int, ...] = ()  # the step units join the epoch in progress, each time

    @classmethod
    def constant(cls, global_batch: int) -> BatchSchedule:
        return cls((0,), (global_batch,))

    def with_seq_lens(self, stages: Sequence[tuple[int, int]]) -> BatchSchedule:
        """This schedule with seq_len `stages` [(first step, seq_len), ...] from step 0."""
        starts = checked_starts("seq_len_schedule", [step for step, _ in stages])
        lengths = tuple(int(length) for _, length in stages)
        for step, length in zip(starts, lengths, strict=True):
            if length < 1:
                raise ConfigError(f"seq_len_schedule: seq_len {length} from step {step} "
                                  "must be >= 1")
        return replace(self, seq_starts=starts, seq_lens=lengths)

    def with_exclusion(self, step: int) -> BatchSchedule:
        """This schedule with one more exclusion, in force from `step` on (no earlier than
        the last one's)."""
        return replace(self, exclusion_starts=appended_start(
            self.exclusion_starts, step, "an exclusion"))

    def exclusions_at(self, step: int) -> int:
        """How many of the run's exclusions are in force at step `step`."""
        return starts_by(self.exclusion_starts, step)

    def joins_at(self, step: int) -> int:
        """How many of the run's joins of units into an epoch are in force at `step`."""
        return starts_by(self.join_starts, step)

    def seq_len_at(self, step: int) -> int | None:
        """The seq_len of step `step` (None: no seq_len stages)."""
        if not self.seq_lens:
            return None
        return self.seq_lens[stage_of(self.seq_starts, step)]

    def stages(self) -> list[tuple[int, int, int | None]]:
        """[(first step, global batch, seq_len)] at every step where either changes."""
        steps = sorted({*self.starts, *self.seq_starts})
        return [(step, self.at(step), self.seq_len_at(step)) for step in steps]

    @classmethod
    def of(cls, stages: Sequence[tuple[int, int]], world_size: int) -> BatchSchedule:
        """[(first step, global batch size), ...] from step 0, in increasing steps; each size
        a multiple of the world size (every rank takes the same rows)."""
        starts = checked_starts("batch_schedule", [step for step, _ in stages])
        sizes = [int(size) for _, size in stages]
        for step, size in zip(starts, sizes, strict=True):
            if size < world_size or size % world_size:
                raise ConfigError(f"batch_schedule: global batch {size} from step {step} is "
                                  f"not a multiple of the world size {world_size} (each rank "
                                  "takes the same number of rows)")
        return cls(starts, tuple(sizes))

    @staticmethod
    def ramp(start: int, end: int, increment: int, steps_per_increment: int,
             first_step: int = 0) -> list[tuple[int, int]]:
        """The stages of a ramp from `start` to `end` global rows, `increment` more every
        `steps_per_increment` steps from `first_step` (Megatron's --rampup-batch-size, by
        steps)."""
        if increment < 1 or steps_per_increment < 1 or end < start:
            raise ConfigError("ramp: needs end >= start, increment >= 1 and "
                              "steps_per_increment >= 1")
        sizes = [*range(start, end, increment), end]
        return [(first_step + index * steps_per_increment, size)
                for index, size in enumerate(sizes)]

    @property
    def largest(self) -> int:
        return max(self.sizes)

    def at(self, step: int) -> int:
        """The global batch of step `step`."""
        return self.sizes[stage_of(self.starts, step)]

    def next_change(self, step: int) -> int | None:
        """The first step after `step` whose global batch or seq_len may differ (None:
        none)."""
        later = [start for start in (*self.starts, *self.seq_starts, *self.exclusion_starts,
                                     *self.join_starts) if start > step]
        return min(later) if later else None

    def phases_at(self, cursor: Cursor) -> Cursor:
        """The cursor with the seq_len, the exclusions and the joins of its step in force:
        any other than its last phase's begins a phase at its position (at position 0,
        replaces that phase)."""
        last = cursor.phases[-1]
        seq_len = self.seq_len_at(cursor.step) or last.seq_len
        excluded = max(self.exclusions_at(cursor.step), last.excluded)
        joined = max(self.joins_at(cursor.step), last.joined)
        if (seq_len, excluded, joined) == (last.seq_len, last.excluded, last.joined):
            return cursor
        if cursor.position == 0:
            return replace(cursor, phases=(*cursor.phases[:-1],
                                           Phase(seq_len, last.begins, excluded, joined)))
        return replace(cursor, position=0, phases=(
            *cursor.phases, Phase(seq_len, cursor.position, excluded, joined)))

    def segments(self, plan_size: PlanSize, cursor: Cursor, one_epoch: bool = False
                 ) -> Iterator[Segment]:
        """The runs of equal global batch and seq_len from `cursor` on, epoch after epoch,
        without end (`one_epoch`: to the end of the cursor's epoch, the next epoch's size
        never asked); an epoch's tail that holds no whole step is left."""
        while True:
            cursor = self.phases_at(cursor)
            epoch, position, step, phases = (cursor.epoch, cursor.position, cursor.step,
                                             cursor.phases)
            size, global_batch = plan_size(epoch, phases), self.at(step)
            fit = (size - position) // global_batch
            if fit <= 0:
                if position == 0 and len(phases) == 1:
                    raise ConfigError(f"epoch {epoch} holds {size} observations, fewer than "
                                      f"one global step of {global_batch}")
                if one_epoch:
                    return
                cursor = cursor.next_epoch()
                continue
            change = self.next_change(step)
            steps = fit if change is None else min(fit, change - step)
            yield Segment(epoch, position, step, steps, global_batch, phases)
            cursor = Cursor(epoch, position + steps * global_batch, step + steps, phases)

    def walk(self, plan_size: PlanSize, cursor: Cursor, steps: int) -> Cursor:
        """The cursor `steps` steps on from `cursor`; a step that does not fit its epoch's
        tail starts the next epoch."""
        if steps == 0:
            return cursor
        for segment in self.segments(plan_size, cursor):
            if steps <= segment.steps:
                return segment.cursor(steps)
            steps -= segment.steps
        raise AssertionError("segments never end")

    def steps_before(self, plan_size: PlanSize, epoch: int, position: int, phases: Phases
                     ) -> int:
        """Global steps taken from the start of training to (epoch, position) of its first
        phase, a position this schedule's walk reaches (for a state saved without its step
        count: raypipe.sampling.state_compat)."""
        steps = 0
        for segment in self.segments(plan_size, Cursor(0, 0, 0, phases)):
            if segment.epoch > epoch or (segment.epoch, segment.position) >= (epoch, position):
                return steps
            if segment.epoch == epoch and position < segment.step_start(segment.steps):
                return steps + (position - segment.position) // segment.global_batch
            steps += segment.steps
        raise AssertionError("segments never end")


def walk_rows(plan_size: PlanSize, cursor: Cursor, count: int, what: str,
              describe: bool = True) -> tuple[list[tuple[int, int, Phases]], Cursor]:
    """The next `count` rows from `cursor` as (epoch, position, phases) (none unless
    `describe`), and the cursor after them (its step as given): a mixture source's walk,
    which takes rows, not steps, so an epoch ends at its last row (no drop-last) and the
    next begins with the following one (`Cursor.next_epoch`). `what` names the source in
    the error for an epoch that holds no row."""
    taken: list[tuple[int, int, Phases]] = []
    left = count
    while left:
        size = plan_size(cursor.epoch, cursor.phases)
        if size <= 0 and len(cursor.phases) == 1:
            raise ConfigError(f"{what}: epoch {cursor.epoch} holds no row")
        if cursor.position >= size:
            cursor = cursor.next_epoch()
            continue
        take = min(left, size - cursor.position)
        if describe:
            taken += [(cursor.epoch, cursor.position + i, cursor.phases) for i in range(take)]
        cursor, left = replace(cursor, position=cursor.position + take), left - take
    return taken, cursor


def batch_shape(batch_size: int | None, batch_schedule: Sequence[tuple[int, int]] | None,
                world_size: int) -> tuple[BatchSchedule | None, int | None]:
    """(the schedule of global rows by step, None without one; rows per rank for the
    buffers: `batch_size`, or the schedule's largest stage's share) from one or the other,
    never both."""
    if not batch_schedule:
        return None, batch_size
    if batch_size is not None:
        raise ConfigError("give batch_size (rows per rank, every step) or batch_schedule "
                          "(global rows by step), not both")
    schedule = BatchSchedule.of(batch_schedule, world_size)
    return schedule, schedule.largest // world_size


def appended_start(starts: tuple[int, ...], step: int, what: str) -> tuple[int, ...]:
    """`starts` with one more change from `step` on (no earlier than the last one's)."""
    if starts and step < starts[-1]:
        raise ConfigError(f"{what} from step {step} comes before the last one's, from step "
                          f"{starts[-1]}")
    return (*starts, int(step))


def starts_by(starts: tuple[int, ...], step: int) -> int:
    """How many of the changes beginning at `starts` are in force at step `step`."""
    return int(np.searchsorted(np.array(starts, dtype=np.int64), step, side="right"))


def stage_of(starts: tuple[int, ...], step: int) -> int:
    """The stage in force at `step` (`starts`: each stage's first step, from 0)."""
    return int(np.searchsorted(np.array(starts), step, side="right")) - 1


def checked_starts(what: str, steps: Sequence[int]) -> tuple[int, ...]:
    """Stages' first steps: from step 0, increasing."""
    starts = tuple(int(step) for step in steps)
    if not starts or starts[0] != 0:
        raise ConfigError(f"{what}: steps {list(starts)} must start at step 0")
    if any(later <= earlier for earlier, later in zip(starts, starts[1:], strict=False)):
        raise ConfigError(f"{what}: steps {list(starts)} must increase")
    return starts


def seq_len_stages_by_tokens(stages: Sequence[tuple[int, int]], batch: BatchSchedule
                             ) -> list[tuple[int, int]]:
    """[(tokens trained, seq_len), ...] -> [(first step, seq_len), ...]: each stage begins
    at the first step at which `tokens` target positions (global batch x seq_len a step,
    under `batch`) have been trained; the first must be at 0 tokens."""
    checked_starts("seq_len by tokens", [tokens for tokens, _ in stages])
    steps, step, trained, seq_len = [(0, int(stages[0][1]))], 0, 0, int(stages[0][1])
    for tokens, length in stages[1:]:
        while trained < tokens:
            later = [start for start in batch.starts if start > step]
            per_step = batch.at(step) * seq_len
            needed = -(-(tokens - trained) // per_step)
            taken = needed if not later else min(needed, later[0] - step)
            step, trained = step + taken, trained + taken * per_step
        steps.append((step, int(length)))
        seq_len = int(length)
    return steps
