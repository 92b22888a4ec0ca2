"""What a rank reads ahead (raypipe.loader.reads): the units of the steps described ahead,
kept as steps come and go, against the same figures recomputed from the steps."""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.loader.reads import Upcoming


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

