"""The node facts every rank plans with: the ranks that share a node cache, and its budget.

Invariant: a windowed shuffle cuts its blocks and sizes its windows from the node cache's
budget and the node's ranks (the loader's `node_ranks`, else LOCAL_WORLD_SIZE), and a
shard-local one its groups from the budget, so every rank of a run must plan with the
same two numbers, or ranks read different plans and the epoch serves some documents twice
and others never. Where
torch.distributed is initialized over the loader's ranks, they agree: every rank plans
with the most ranks any node has and the least budget any node gives, so nodes that
differ (Ray Train places 12 workers on nodes of 8 GPUs as 8 + 4; a node given another
RAYPIPE_CACHE_BYTES) still cut the same blocks, windows that fit every node's cache; rank
0 says so once. Without a process group a rank plans with its own, and every node must
give the same (docs/cluster.md). A global shuffle, and a validation split under "auto",
plan from neither, and agree nothing. Cost: one all_gather_object of two integers a rank,
once at open.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from raypipe.io.cache import configured_budget
from raypipe.loader.options import LoaderOptions
from raypipe.sampling.epochs import node_ranks
from raypipe.sampling.modes import PlanSpec

logger = logging.getLogger("raypipe")


@dataclass(frozen=True)
class NodeFacts:
    """`ranks`: training ranks that share the node cache (LOCAL_WORLD_SIZE); `cache_bytes`:
    its budget."""

    ranks: int
    cache_bytes: int

    @classmethod
    def here(cls, cache_bytes: int | str | None, ranks: int | None = None) -> NodeFacts:
        """This rank's own: `ranks` as given, else LOCAL_WORLD_SIZE (1 unset), and
        `cache_bytes` as configured (else $RAYPIPE_CACHE_BYTES, else the default)."""
        return cls(ranks or node_ranks(), configured_budget(cache_bytes))

    @classmethod
    def agreed(cls, options: LoaderOptions, rank: int, world_size: int,
               root: str) -> NodeFacts:
        """The facts every rank of the loader's world plans `options.plan` with (`root`:
        what the warning names)."""
        plan = options.plan
        own = cls.here(options.cache_bytes, options.node_ranks)
        if not (plans_from_node(plan) and spans_process_group(rank, world_size)):
            return own
        gathered: list[NodeFacts | None] = [None] * world_size
        torch.distributed.all_gather_object(gathered, own)
        every = [facts for facts in gathered if facts is not None]
        agreed = cls(max(facts.ranks for facts in every),
                     min(facts.cache_bytes for facts in every))
        if rank == 0 and any(facts != agreed for facts in every):
            logger.warning("%s: the nodes differ (node ranks %s, cache_bytes %s): every "
                           "rank plans the shuffle for %d rank(s) a node and cache_bytes %s "
                           "(the most ranks and the least budget), so all cut the same "
                           "blocks and every node's windows fit its cache",
                           root, spread(facts.ranks for facts in every),
                           spread(facts.cache_bytes for facts in every), agreed.ranks,
                           f"{agreed.cache_bytes:,}")
        return agreed


def plans_from_node(plan: PlanSpec) -> bool:
    """The plan may follow the node's facts: a windowed or shard-local shuffle, or "auto"
    (it resolves to one on object storage) but for a validation split (global)."""
    if plan.shuffle == "auto":
        return plan.split != "validation"
    return plan.shuffle != "global"


def spans_process_group(rank: int, world_size: int) -> bool:
    """torch.distributed is initialized over exactly the loader's ranks (a loader a rank
    opens alone, world_size 1 or another world, takes part in no collective)."""
    distributed = torch.distributed
    return (world_size > 1 and distributed.is_available() and distributed.is_initialized()
            and distributed.get_world_size() == world_size
            and distributed.get_rank() == rank)


def spread(values: Iterable[int]) -> str:
    """`low-high` of integers, or the one value."""
    ordered = sorted(set(values))
    return f"{ordered[0]:,}" if len(ordered) == 1 else f"{ordered[0]:,}-{ordered[-1]:,}"
