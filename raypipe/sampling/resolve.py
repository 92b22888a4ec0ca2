"""One resolution of a run's shuffle: `resolve` is the one place a spec's shuffle "auto" and
its layout's undecided knobs (block_bytes, window_blocks, lanes, group_shards 0; lane_ends
auto) are decided.

Invariant: `resolve(asked, facts)` is a pure function of the spec as given and the facts of
the run (`RunFacts`: where the data lives, the world size it starts at, the node cache's
budget, a resumed state's knobs, a mixture's sibling source), so every rank of every node
resolves the same spec, and resolving a resolved spec changes nothing. In order: a resumed
state's shuffle and layout where the run asked "auto" and 0 (a state from before the
knobs: global); else a mixture's one shuffle and layout for all its sources (the first
source on object storage resolves them for its part of the cache); then "auto" by storage
(global on local disk; on object storage windowed where the mode reads documents and the
split is shuffled, else shard_local where the cache holds less than the dataset), group_shards
0 by the budget, lane_ends auto nearby, lane_ranks 0 one and lanes 0 the world size over
it, blocks and window 0 by the budget (a node holding its lanes' windows). Cost:
microseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from raypipe.sampling.blocks import WindowBudget
from raypipe.sampling.modes import PlanSpec
from raypipe.sampling.plans import LANE_ENDS_AUTO, NEARBY_LANE_ENDS

# a shuffle's layout knobs (windowed: blocks, window, lanes; shard_local: its groups), and
# the value of each that the run leaves to decide
LAYOUT_UNDECIDED: dict[str, Any] = {"block_bytes": 0, "window_blocks": 0, "lanes": 0,
                                    "lane_ranks": 0, "lane_ends": LANE_ENDS_AUTO,
                                    "group_shards": 0}
SHUFFLE_LAYOUT = tuple(LAYOUT_UNDECIDED)


@dataclass(frozen=True)
class RunFacts:
    """What a spec is resolved against: whether the data is on local disk; the world size
    the run starts at (None: lanes as given); the node cache's budget (None: blocks and
    window as given); a resumed loader state's knobs, in today's names (None: a fresh run);
    the resolved spec of the mixture source whose shuffle and layout every source takes
    (None: no mixture, or this is that source)."""

    local: bool
    world_size: int | None = None
    budget: WindowBudget | None = None
    saved: Mapping[str, Any] | None = None
    sibling: PlanSpec | None = None


def resolve(asked: PlanSpec, facts: RunFacts) -> PlanSpec:
    """`asked` with its shuffle and the shuffle's layout decided from `facts`."""
    spec = asked
    if facts.saved is not None:
        spec = replace(spec, shuffle=(facts.saved.get("shuffle", "global")
                                      if asked.shuffle == "auto" else asked.shuffle),
                       **{name: (facts.saved.get(name, undecided)
                                 if getattr(asked, name) == undecided
                                 else getattr(asked, name))
                          for name, undecided in LAYOUT_UNDECIDED.items()})
    elif facts.sibling is not None:
        spec = replace(spec, shuffle=facts.sibling.shuffle, **shuffle_layout(facts.sibling))
    spec = spec.for_storage(facts.local, facts.budget)
    if spec.lane_ends == LANE_ENDS_AUTO:
        spec = replace(spec, lane_ends=NEARBY_LANE_ENDS)
    budget = facts.budget
    if facts.world_size is not None:
        spec = spec.for_world(facts.world_size)
    if budget is not None:
        spec = spec.for_budget(budget.for_lanes(spec.lane_ranks))
    return spec


def as_asked(spec: PlanSpec, asked: PlanSpec) -> PlanSpec:
    """`spec` (its data's knobs decided) with the shuffle and layout of `asked` (as given:
    what a later `resolve` decides again, from a state or a sibling)."""
    return replace(spec, shuffle=asked.shuffle, **shuffle_layout(asked))


def shuffle_layout(spec: PlanSpec) -> dict[str, Any]:
    """The layout knobs of a spec's shuffle (`SHUFFLE_LAYOUT`), as resolved."""
    return {name: getattr(spec, name) for name in SHUFFLE_LAYOUT}
