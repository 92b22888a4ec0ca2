"""Loader states of earlier releases read as today's: the loader state's one compatibility
module (the config's is raypipe.config.compat, the manifest's raypipe.io.manifest_compat).

Invariant: every way a state that an earlier release saved differs from today's is named
here and read here as today's shape, so a resume continues at the very batch it was saved
before (tests/test_golden.py resumes every 0.6 state):
- a knob a state leaves out holds the value it had before the knob existed
  (`KNOBS_BEFORE`, and a mode's own knobs' in `MODE_KNOBS_BEFORE`, keyed by the mode's
  name): `shuffle` global before 0.3 (with no `group_shards`), `split` all before 0.4
  (no `validation_fraction`), `window_blocks` and `lanes` 0 before 0.7, `lane_ends`
  spread before 0.7 (the longer lanes' rest read by every rank), `balance` none
  before 0.7 (no `balance_hidden`), `block_bytes` whole shards (`WHOLE_SHARDS`) in a
  state saved before windows were made of blocks, which saved `window_blocks` as
  `window_shards` (`KNOB_RENAMES`); bestfit's `packing` crop before 0.2 (no `pieces`),
  `pieces` edges before 0.5, `overlong` cut before 0.6, `block_order` shuffled before
  0.7. Today's states leave out a knob at that value too (`compact_knobs`), so a state
  of today loads in the release that added the knob;
- a mode saved by its name before 0.7 (`MODE_RENAMES`: `llmbatch` now serves any batch
  format, as `batches`), which also still selects the mode (one deprecation line);
- a state without `steps` (before 0.7) counts them from its position (`steps_taken`);
- a mixture source without `phases` or `stage_base` (before 0.7) stands in one phase at the
  state's seq_len (`implied_phases`), its weights balanced from the start.
Cost: microseconds per state read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from raypipe.io.states import LoaderState, MixtureState, read_any_state
from raypipe.sampling.blocks import WHOLE_SHARDS
from raypipe.sampling.plans import SPREAD_LANE_ENDS

logger = logging.getLogger("raypipe")

# knob -> (its value before it existed, the knobs left out with it)
KnobsBefore = dict[str, tuple[Any, tuple[str, ...]]]
KNOBS_BEFORE: KnobsBefore = {
    "shuffle": ("global", ("group_shards", "block_bytes", "window_blocks", "lanes",
                           "lane_ends")),  # 0.3
    "window_blocks": (0, ()),  # before 0.7: no windowed shuffle
    "lanes": (0, ()),
    "block_bytes": (WHOLE_SHARDS, ()),  # windows of whole shards
    "lane_ends": (SPREAD_LANE_ENDS, ()),  # before 0.7: the longer lanes' rest read by every rank
    "split": ("all", ("validation_fraction",)),  # before 0.4: no validation split
    "balance": ("none", ("balance_hidden",)),  # before 0.7: rows in the plan's order
}
# a mode's own knobs: mode -> {knob -> (its value before it existed, companions)}
MODE_KNOBS_BEFORE: dict[str, KnobsBefore] = {
    "bestfit": {
        "packing": ("crop", ("pieces",)),  # before 0.2: crop packing only (no pieces)
        "pieces": ("edges", ()),  # before 0.5: pieces cut edge to edge, another rule
        "overlong": ("cut", ()),  # before 0.6: a document over a row cut edge to edge
        "block_order": ("shuffled", ()),  # before 0.7: a block's rows shuffled
    },
}
KNOB_RENAMES = {"window_shards": "window_blocks"}  # knobs renamed: old -> today's
MODE_RENAMES = {"llmbatch": "batches"}  # loader modes renamed: old name -> today's (0.7)
_warned: set[str] = set()


def knobs_before(mode: Any) -> KnobsBefore:
    """Every knob's value from before it existed, the shared ones' and mode `mode`'s."""
    return {**KNOBS_BEFORE, **MODE_KNOBS_BEFORE.get(mode, {})}


def compact_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """`knobs` without those at their value from before they existed (and their
    companions): what a loader state records."""
    compact = dict(knobs)
    for added, (before, companions) in knobs_before(knobs.get("mode")).items():
        if added in compact and compact[added] == before:
            for name in (added, *companions):
                compact.pop(name, None)
    return compact


def upgrade_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """A saved state's knobs with each one it leaves out at its value from before it
    existed (what an earlier release ran with; companions keep their defaults)."""
    table = knobs_before(knobs.get("mode"))
    renamed = {KNOB_RENAMES.get(name, name): value for name, value in knobs.items()}
    return {**{knob: before for knob, (before, _) in table.items()}, **renamed}


def current_mode_name(name: str) -> str:
    """Today's name of mode `name` (a retired name: one deprecation line per process)."""
    if name not in MODE_RENAMES:
        return name
    if name not in _warned:
        _warned.add(name)
        logger.warning("loader mode %r is now called %r; the old name keeps working",
                       name, MODE_RENAMES[name])
    return MODE_RENAMES[name]


def former_mode_names() -> tuple[str, ...]:
    """The names modes had that still select them."""
    return tuple(MODE_RENAMES)


def upgraded(state: Any) -> Any:
    """A state dict with a mode saved by a retired name under today's (other values: as
    they are, for the record's reader to refuse)."""
    if isinstance(state, dict) and isinstance(state.get("knobs"), dict) \
            and state["knobs"].get("mode") in MODE_RENAMES:
        return {**state, "knobs": {**state["knobs"],
                                   "mode": MODE_RENAMES[state["knobs"]["mode"]]}}
    return state


def read_state(state: dict[str, Any] | None) -> LoaderState | MixtureState | None:
    """A loader's or a mixture's state from its dict (None: None), upgraded; a problem is
    a StateError naming the field."""
    return read_any_state(upgraded(state))


def steps_taken(saved: LoaderState, count: Callable[[], int]) -> int:
    """The global steps a state had taken: recorded, or (a state without them) `count()`,
    counted from its position under the schedule."""
    return saved.steps if saved.steps is not None else count()


def implied_phases(saved_seq_len: int, seq_len: int) -> list[list[int]] | None:
    """The phases of a mixture source position saved without them (one, at the state's
    seq_len), as a schedule at `seq_len` records them (None: its own seq_len)."""
    return None if saved_seq_len == seq_len else [[saved_seq_len, 0]]
