"""What a rank reads ahead: the described steps of a segment (a mixture: of its stretch),
each with the shards or blocks it reads already on their way from object storage, and
whether a step's reads have arrived (the batches before one that would wait are handed
over first).

Invariant: before the producer thread fills a step, every read the next steps need is in
flight, issued from the schedule in the order the steps read it, and what no coming step
reads is let go; nothing is fetched serially on the training thread's path. A mixture's
steps read several datasets: each source's reads are issued and let go on its own
dataset, within its part of the node cache. A local dataset reads nothing ahead. Cost:
one `fetch_units` per chunk of steps (whole shards) or one `job_units` per step and
dataset it reads (blocks), O(rows) numpy, plus the cache's prefetch calls (blocks: only
where a step's blocks came or went, and every 8 steps) and one look at the step's
blocks' fetches (`arrived`: O(blocks of the step), a few dict lookups).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from raypipe.sampling.buffers import DescribedRows
from raypipe.sampling.modes import BatchFiller
from raypipe.sampling.schedule import Segment

READ_AHEAD_STEPS = 64  # a dataset read in blocks: steps described ahead of the one served
DESCRIBED_TOGETHER = 8  # ... described a few at a time, before each step served

StepT = TypeVar("StepT")
# what a step reads: (index of the dataset among the reader's, its units of fetch) each
StepUnits = list[tuple[int, np.ndarray]]


class Upcoming:
    """The units the steps described ahead read, in the order they came in (a unit read
    by pending steps since an earlier step, already asked for, stays ahead of those that
    came after it), with how many of those steps read each; `changed` says whether a unit
    came or went since it was last cleared. Cost: O(units of a step) a step."""

    def __init__(self) -> None:
        self.readers: dict[int, int] = {}
        self.changed = False

    def add(self, units: np.ndarray) -> None:
        for unit in units.tolist():
            count = self.readers.get(unit)
            if count is None:
                self.readers[unit] = 1
                self.changed = True
            else:
                self.readers[unit] = count + 1

    def remove(self, units: np.ndarray) -> None:
        for unit in units.tolist():
            count = self.readers[unit] - 1
            if count:
                self.readers[unit] = count
            else:
                del self.readers[unit]
                self.changed = True


class StepReads(Generic[StepT]):
    """Steps (`steps`, described lazily: a few are taken at a time) served with their
    reads issued ahead over the next READ_AHEAD_STEPS steps: `units_of(step)` says what a
    step reads of each of `datasets`. A dataset read in blocks has its reads let go once
    no coming step reads them; one read in whole shards is only fetched ahead (its open
    shards stay within its budget: raypipe.dataset). `arrived(step)` says whether the step
    last yielded can be filled without waiting on a request."""

    def __init__(self, steps: Iterator[StepT], units_of: Callable[[StepT], StepUnits],
                 datasets: Sequence[Any]):
        self.source, self.units_of, self.datasets = steps, units_of, datasets
        self.last: tuple[StepT | None, StepUnits] = (None, [])
        self.steps = self._ahead()

    def __iter__(self) -> Iterator[StepT]:
        return self.steps

    def arrived(self, step: StepT) -> bool:
        job, reads = self.last
        return job is not step or all(self.datasets[index].arrived(units.tolist())
                                      for index, units in reads)

    def _ahead(self) -> Iterator[StepT]:
        """All READ_AHEAD_STEPS steps are taken before the first is served, so its reads
        and the next ones' go out together; then DESCRIBED_TOGETHER at a time, one such
        take before each step served, so no step waits behind a long description. The
        prefetch is asked again where a unit came or went, and every DESCRIBED_TOGETHER
        steps (what an eviction by another process took is asked for again)."""
        pending: deque[tuple[StepT, StepUnits]] = deque()
        upcoming = [Upcoming() for _ in self.datasets]
        first, served_steps = True, 0
        while True:
            while len(pending) < READ_AHEAD_STEPS:
                few = list(itertools.islice(self.source, DESCRIBED_TOGETHER))
                for step in few:
                    reads = self.units_of(step)
                    pending.append((step, reads))
                    for index, units in reads:
                        upcoming[index].add(units)
                if not few or not first:
                    break
            first = False
            if not pending:
                return
            for dataset, ahead in zip(self.datasets, upcoming, strict=True):
                if ahead.changed or served_steps % DESCRIBED_TOGETHER == 0:
                    ahead.changed = False
                    _ask(dataset, list(ahead.readers))
            served = pending.popleft()
            for index, units in served[1]:
                upcoming[index].remove(units)
            served_steps += 1
            self.last = served
            yield served[0]


def _ask(dataset: Any, ordered: list[int]) -> None:
    """Fetch `ordered` ahead; a dataset read in blocks lets go of every other block."""
    if dataset.blocks is not None:
        dataset.close_except(ordered)
    dataset.prefetch(ordered)


def fetched_ahead(dataset: Any) -> bool:
    """Whether a dataset's reads are issued ahead step by step (read in blocks from
    object storage)."""
    return dataset.cache is not None and getattr(dataset, "blocks", None) is not None


class ReadAhead:
    """One dataset's described steps of the segment of `run` (a Run), with their reads
    issued ahead: read in blocks, `StepReads` over its steps described DESCRIBED_TOGETHER
    at a time; else whole shards, `_shards_ahead`. `arrived(step)` says whether the step
    last yielded can be filled without waiting on a request (so the batches before it are
    handed over first)."""

    def __init__(self, run: Any, filler: BatchFiller, segment: Segment):
        self.reads = (StepReads(_described(run, filler, segment),
                                lambda job: [(0, filler.job_units(job))], [run.dataset])
                      if fetched_ahead(run.dataset) else None)
        self.steps = (iter(self.reads) if self.reads is not None
                      else _shards_ahead(run, filler, segment))

    def __iter__(self) -> Iterator[DescribedRows]:
        return self.steps

    def arrived(self, step: DescribedRows) -> bool:
        return self.reads is None or self.reads.arrived(step)


def _described(run: Any, filler: BatchFiller, segment: Segment
               ) -> Iterator[DescribedRows]:
    """The segment's steps for this rank, described DESCRIBED_TOGETHER at a time."""
    for positions, _ in run.rank_chunks(segment):
        for first in range(0, len(positions), DESCRIBED_TOGETHER):
            yield from filler.describe(positions[first:first + DESCRIBED_TOGETHER])


def _shards_ahead(run: Any, filler: BatchFiller, segment: Segment
                  ) -> Iterator[DescribedRows]:
    """Object storage: each chunk's shards fetched ahead, then those the shuffle plans next
    or, where it plans none, those of the next chunk of steps; the shards of windows already
    read are closed."""
    dataset = run.dataset
    for positions, following in run.rank_chunks(segment):
        if dataset.cache is not None:
            needed = filler.fetch_units(positions).tolist()
            dataset.prefetch(needed)
            ahead = filler.units_ahead(int(positions[0, 0]))
            if ahead is not None:
                dataset.close_except([*needed, *ahead.tolist()])
                dataset.prefetch(ahead.tolist())
            elif following is not None:
                dataset.prefetch(filler.fetch_units(following).tolist())
        yield from filler.describe(positions)
