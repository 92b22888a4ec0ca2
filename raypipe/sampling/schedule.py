"""Global batch size by step, and the one walk of a loader's steps under it.

Invariant: the global batch of global step s (observations every rank takes together) is a
pure function of the schedule and s: stage k's size from its first step `starts[k]` to the
next stage's (a ramp is a run of stages, as Megatron's --rampup-batch-size and OLMo-core's
batch-size scheduler make). An epoch's steps take their global batch each, one after
another from where the last ended, while a whole step fits (drop-last: the tail that does
not is left, counted in the epoch's report), so the (epoch, position) of any step is a pure
function of (the schedule, the epochs' sizes, the (epoch, position, step) walked from).
`segments` yields the runs of equal global batch in an epoch, which the loader fills and
`raypipe trace` replays. Cost: O(stages + epochs) to walk any number of steps, nothing per
batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from raypipe.errors import ConfigError


@dataclass(frozen=True)
class Segment:
    """`steps` consecutive steps of epoch `epoch` from observation `position` and global
    step `step`, each of `global_batch` observations."""

    epoch: int
    position: int
    step: int
    steps: int
    global_batch: int

    def step_start(self, index: int) -> int:
        """The first observation of the segment's `index`-th step."""
        return self.position + index * self.global_batch


@dataclass(frozen=True)
class BatchSchedule:
    """Global batch size by step: `sizes[k]` observations a step from step `starts[k]`."""

    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def constant(cls, global_batch: int) -> BatchSchedule:
        return cls((0,), (global_batch,))

    @classmethod
    def of(cls, stages: Sequence[tuple[int, int]], world_size: int) -> BatchSchedule:
        """[(first step, global batch size), ...] from step 0, in increasing steps; each size
        a multiple of the world size (every rank takes the same rows)."""
        starts = [int(step) for step, _ in stages]
        sizes = [int(size) for _, size in stages]
        if not starts or starts[0] != 0:
            raise ConfigError(f"batch_schedule: {list(stages)} must start at step 0")
        if any(later <= earlier for earlier, later in zip(starts, starts[1:], strict=False)):
            raise ConfigError(f"batch_schedule: steps {starts} must increase")
        for step, size in zip(starts, sizes, strict=True):
            if size < world_size or size % world_size:
                raise ConfigError(f"batch_schedule: global batch {size} from step {step} is "
                                  f"not a multiple of the world size {world_size} (each rank "
                                  "takes the same number of rows)")
        return cls(tuple(starts), tuple(sizes))

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
        return self.sizes[int(np.searchsorted(np.array(self.starts), step, side="right")) - 1]

    def next_change(self, step: int) -> int | None:
        """The first step after `step` whose global batch may differ (None: none)."""
        later = [start for start in self.starts if start > step]
        return later[0] if later else None

    def segments(self, epoch_size: Callable[[int], int], epoch: int, position: int,
                 step: int, one_epoch: bool = False) -> Iterator[Segment]:
        """The runs of equal global batch from (epoch, position, step) on, epoch after
        epoch, without end (`one_epoch`: to the end of `epoch`, the next epoch's size never
        asked); an epoch's tail that holds no whole step is left."""
        while True:
            size, global_batch = epoch_size(epoch), self.at(step)
            fit = (size - position) // global_batch
            if fit <= 0:
                if position == 0:
                    raise ConfigError(f"epoch {epoch} holds {size} observations, fewer than "
                                      f"one global step of {global_batch}")
                if one_epoch:
                    return
                epoch, position = epoch + 1, 0
                continue
            change = self.next_change(step)
            steps = fit if change is None else min(fit, change - step)
            yield Segment(epoch, position, step, steps, global_batch)
            position, step = position + steps * global_batch, step + steps

    def walk(self, epoch_size: Callable[[int], int], epoch: int, position: int, step: int,
             steps: int) -> tuple[int, int, int]:
        """(epoch, position, step) `steps` steps on from (epoch, position, step); a step
        that does not fit its epoch's tail starts the next epoch."""
        if steps == 0:
            return epoch, position, step
        for segment in self.segments(epoch_size, epoch, position, step):
            if steps <= segment.steps:
                return segment.epoch, segment.step_start(steps), segment.step + steps
            steps -= segment.steps
        raise AssertionError("segments never end")

    def steps_before(self, epoch_size: Callable[[int], int], epoch: int, position: int
                     ) -> int:
        """Global steps taken from the start of training to (epoch, position), a position
        this schedule's walk reaches (for a state saved without its step count, before
        0.7: under a constant schedule)."""
        steps = 0
        for segment in self.segments(epoch_size, 0, 0, 0):
            if segment.epoch > epoch or (segment.epoch, segment.position) >= (epoch, position):
                return steps
            if segment.epoch == epoch and position < segment.step_start(segment.steps):
                return steps + (position - segment.position) // segment.global_batch
            steps += segment.steps
        raise AssertionError("segments never end")
