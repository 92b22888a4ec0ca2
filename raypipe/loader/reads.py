"""What a rank reads ahead: the described steps of a segment, each with the shards or
blocks it reads already on their way from object storage, and whether a step's reads
have arrived (the batches before one that would wait are handed over first).

Invariant: before the producer thread fills a step, every read the next steps need is in
flight, issued from the schedule in the order the steps read it, and what no coming step
reads is let go; nothing is fetched serially on the training thread's path. A local dataset
reads nothing ahead. Cost: one `fetch_units` per chunk of steps (whole shards) or one
`job_units` per step (blocks), O(rows) numpy, plus the cache's prefetch calls (blocks:
only where a step's blocks came or went, and every 8 steps) and one
look at the step's blocks' fetches (`arrived`: O(blocks of the step), a few dict lookups).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from raypipe.sampling.buffers import DescribedRows
from raypipe.sampling.modes import BatchFiller
from raypipe.sampling.schedule import Segment

READ_AHEAD_STEPS = 64  # a dataset read in blocks: steps described ahead of the one served
DESCRIBED_TOGETHER = 8  # ... described a few at a time, before each step served


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


class ReadAhead:
    """This rank's described steps of the segment of `run` (a Run), with their reads
    issued ahead: a dataset read in blocks, `_blocks_ahead`; else whole shards,
    `_shards_ahead`. `arrived(step)` says whether the step last yielded can be filled
    without waiting on a request (so the batches before it are handed over first)."""

    def __init__(self, run: Any, filler: BatchFiller, segment: Segment):
        self.dataset = run.dataset
        self.last: tuple[DescribedRows | None, np.ndarray | None] = (None, None)
        self.steps = (self._blocks_ahead(run, filler, segment)
                      if getattr(run.dataset, "blocks", None) is not None
                      else _shards_ahead(run, filler, segment))

    def __iter__(self) -> Iterator[DescribedRows]:
        return self.steps

    def arrived(self, step: DescribedRows) -> bool:
        job, units = self.last
        return job is not step or units is None or self.dataset.arrived(units.tolist())

    def _blocks_ahead(self, run: Any, filler: BatchFiller, segment: Segment
                      ) -> Iterator[DescribedRows]:
        for job, units in _blocks_ahead(run, filler, segment):
            self.last = (job, units)
            yield job


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


def _blocks_ahead(run: Any, filler: BatchFiller, segment: Segment
                  ) -> Iterator[tuple[DescribedRows, np.ndarray]]:
    """The blocks each step reads fetched in the order the steps read them, as far as the
    rank's share of the node cache holds, over the next READ_AHEAD_STEPS steps (all of
    them described before the first step, so its reads and the next ones' go out
    together; then DESCRIBED_TOGETHER at a time, one such call before each step served,
    so no step waits behind a long description); the blocks of steps already served are
    let go, and the prefetch is asked again where a block came or went. Each step comes
    with the blocks it reads."""
    dataset, chunks = run.dataset, run.rank_chunks(segment)
    undescribed: deque[np.ndarray] = deque()  # steps' positions, one row a step
    pending: deque[tuple[DescribedRows, np.ndarray]] = deque()
    upcoming = Upcoming()
    first, served_steps = True, 0
    while True:
        while len(pending) < READ_AHEAD_STEPS:
            if not undescribed:
                chunk = next(chunks, None)
                undescribed.extend(() if chunk is None else chunk[0])
            few = [undescribed.popleft()
                   for _ in range(min(DESCRIBED_TOGETHER, len(undescribed)))]
            for job in filler.describe(np.stack(few)) if few else ():
                units = filler.job_units(job)
                pending.append((job, units))
                upcoming.add(units)
            if not few or not first:
                break
        first = False
        if not pending:
            return
        # asked again where a unit came or went, and every DESCRIBED_TOGETHER steps (what
        # an eviction by another process took is asked for again)
        if upcoming.changed or served_steps % DESCRIBED_TOGETHER == 0:
            upcoming.changed = False
            ordered = list(upcoming.readers)
            dataset.close_except(ordered)
            dataset.prefetch(ordered)
        served = pending.popleft()
        upcoming.remove(served[1])
        served_steps += 1
        yield served
