"""What a rank reads ahead (raypipe.loader.reads): the units of the steps described ahead,
kept as steps come and go, against the same figures recomputed from the steps."""

from __future__ import annotations

from collections import deque

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.loader.reads import (
    READ_AHEAD_MAX_STEPS,
    READ_AHEAD_STEPS,
    Upcoming,
    _describes_more,
)


def unit_size(unit: int) -> int:
    return 4096 * (1 + unit % 5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True),
                min_size=1, max_size=60), st.integers(1, 12))
def test_upcoming_units_are_those_of_the_pending_steps_in_the_order_first_needed(
        steps, ahead):
    """Steps come `ahead` at a time and go one at a time: after each, the units and bytes
    kept are those of the pending steps, ordered by the step that brought each in (a unit
    pending steps read since an earlier step, already asked for, stays ahead), and
    `changed` says whether the set of units moved."""
    upcoming = Upcoming(unit_size)
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
        assert upcoming.bytes == sum(unit_size(unit) for unit in read)
        assert upcoming.changed == (read != before)


def test_steps_are_described_to_the_first_count_then_while_their_blocks_fit():
    hold = 1 << 20
    assert _describes_more(READ_AHEAD_STEPS - 1, 10 * hold, hold)  # the first steps always
    assert _describes_more(READ_AHEAD_STEPS, hold - 1, hold)
    assert not _describes_more(READ_AHEAD_STEPS, hold, hold)
    assert not _describes_more(READ_AHEAD_MAX_STEPS, 0, hold)
