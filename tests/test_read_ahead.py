"""What a rank reads ahead (raypipe.loader.reads): the units of the steps described ahead,
kept as steps come and go, against the same figures recomputed from the steps."""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.loader.reads import READ_AHEAD_STEPS, StepReads, StepUnits, Upcoming


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True),
                min_size=1, max_size=60), st.integers(1, 12))
def test_upcoming_units_are_those_of_the_pending_steps_in_the_order_first_needed(
        steps, ahead):
    """Steps come `ahead` at a time and go one at a time: after each, the units kept are
    those of the pending steps, ordered by the step that brought each in (a unit
    pending steps read since an earlier step, already asked for, stays ahead), and
    `changed` says whether the set of units moved."""
    upcoming = Upcoming()
    pending: deque[tuple[int, np.ndarray]] = deque()
    queue = deque(enumerate(np.array(units, dtype=np.int64) for units in steps))
    brought_in: dict[int, tuple[int, int]] = {}  # unit -> (its step, its place there)
    while queue or pending:
        before = set(upcoming.readers)
        upcoming.changed = False
        if queue and len(pending) < ahead:
            index, units = queue.popleft()
            pending.append((index, units))
            upcoming.add(units)
        else:
            upcoming.remove(pending.popleft()[1])
        read = {int(unit) for _, units in pending for unit in units}
        for unit in read - before:
            brought_in[unit] = next((index, units.tolist().index(unit))
                                    for index, units in pending if unit in units)
        expected = sorted(read, key=lambda unit: brought_in[unit])
        assert list(upcoming.readers) == expected
        assert upcoming.changed == (read != before)



class _RecordedDataset:
    """A dataset read in blocks whose read-ahead calls are recorded: what it was last
    asked to fetch and to keep."""

    blocks = ()  # read in blocks (not None)

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.kept: set[int] | None = None

    def prefetch(self, units: list[int]) -> None:
        self.asked = list(units)

    def close_except(self, keep: list[int]) -> None:
        self.kept = set(keep)

    def arrived(self, units: list[int]) -> bool:
        return set(units) <= set(self.asked)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 30)), max_size=6),
                min_size=1, max_size=150))
def test_every_step_of_several_datasets_is_asked_for_before_it_is_served(steps):
    """A mixture's steps read several datasets: when a step is served, each dataset was
    last asked for every unit the READ_AHEAD_STEPS steps from it read there, and kept
    them all (as far as steps remain); the steps come out in order, each once."""
    datasets = [_RecordedDataset() for _ in range(3)]

    def units_of(step: int) -> StepUnits:
        reads = steps[step]
        return [(index, np.array([unit for at, unit in reads if at == index], np.int64))
                for index in sorted({at for at, _ in reads})]

    reads = StepReads(iter(range(len(steps))), units_of, datasets)
    served = []
    for step in reads:
        served.append(step)
        assert reads.arrived(step)
        coming = steps[step:step + READ_AHEAD_STEPS]
        for index, dataset in enumerate(datasets):
            wanted = list(dict.fromkeys(unit for reads_of in coming
                                        for at, unit in reads_of if at == index))
            assert set(wanted) <= set(dataset.asked)
            assert dataset.kept is not None and set(wanted) <= dataset.kept
    assert served == list(range(len(steps)))
