"""Balance: the rows of a step spread over its ranks by what they cost, and a packing
block's rows ordered by cost so a step's rows cost about the same; computed alike on every
rank from the rows alone, with no collective.

Invariant: a cost model is a name in `COST_MODELS` (the `balance` knob; a plugin adds one
with `register_cost_model`); `rank_rows` gives a rank its rows of each step from the costs
of all of the step's rows, so a step holds the same rows under any balance and only which
rank takes which changes (a resume, a world size change and the drop-last tail are as
without it). `assign_rows` is a permutation of a step's world x B rows that gives every rank
exactly B of them (tensor shapes never change), `cost_order` a permutation of one block's
rows (the plan's own order, so a resume, an exclusion or a join mid-epoch serves what is
left as under any order); both are pure functions of the rows' costs and the seed, so every
rank computes the same one, and every row is still served once. The cost of a row under
document-masked attention (varlen kernels, `cu_seqlens`) is about `linear x T + sum of s^2`
over its pieces s: `linear` is 6 x the model's hidden size (a token's linear layers against
one query-key pair, forward and backward, per layer). Cost: O(W log W) a step of W rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from raypipe.errors import ConfigError
from raypipe.sampling.pack import RowPieces

NO_BALANCE = "none"  # rows go to ranks in the plan's order: row i * world + r on rank r


class RowCostModel(Protocol):
    """What a row costs to train, from what it holds (no token read)."""

    def row_costs(self, row_offsets: np.ndarray, take: np.ndarray, seq_len: int
                  ) -> np.ndarray:
        """float64[rows]: the cost of each row of `seq_len` tokens, for rows in CSR form
        (row r is pieces row_offsets[r]:[r + 1] of `take` tokens each)."""


@dataclass(frozen=True)
class AttentionCost:
    """A row's compute under document-masked attention: `linear` x its tokens plus the
    squares of its pieces' lengths (each piece attends only within itself)."""

    linear: float  # 6 x hidden size

    @classmethod
    def of_model(cls, hidden_size: int) -> AttentionCost:
        return cls(6.0 * hidden_size)

    def row_costs(self, row_offsets: np.ndarray, take: np.ndarray,
                  seq_len: int) -> np.ndarray:
        """Every row is `seq_len` tokens for the linear term (padding runs through the
        layers too)."""
        offsets = np.asarray(row_offsets, dtype=np.int64)
        squares = np.concatenate([[0.0], np.cumsum(np.asarray(take, np.float64) ** 2)])
        return self.linear * seq_len + squares[offsets[1:]] - squares[offsets[:-1]]


def costs_of(model: RowCostModel, rows: Sequence[RowPieces], seq_len: int) -> np.ndarray:
    """float64[len(rows)]: what each row costs under `model`."""
    counts = np.fromiter((len(row.take) for row in rows), np.int64, len(rows))
    offsets = np.concatenate([[0], np.cumsum(counts)])
    take = np.concatenate([row.take for row in rows]) if rows else np.empty(0, np.int64)
    return model.row_costs(offsets, take, seq_len)


# balance name -> the cost model of a model of that hidden size
COST_MODELS: dict[str, Callable[[int], RowCostModel]] = {"attention": AttentionCost.of_model}


def register_cost_model(name: str, of_model: Callable[[int], RowCostModel]) -> None:
    """Make `balance=name` cost rows with `of_model(hidden_size)` (a plugin's model)."""
    if name == NO_BALANCE:
        raise ConfigError(f"balance {NO_BALANCE!r} is taken: rows in the plan's order")
    COST_MODELS[name] = of_model


def balance_names() -> tuple[str, ...]:
    """The values of the `balance` knob: none, then every cost model's name."""
    return (NO_BALANCE, *COST_MODELS)


def cost_model(balance: str, hidden_size: int) -> RowCostModel | None:
    """The cost model `balance` names, for a model of `hidden_size` (None: no balance)."""
    if balance == NO_BALANCE:
        return None
    if balance not in COST_MODELS:
        raise ConfigError(f"balance: {balance!r} not among {list(balance_names())}")
    return COST_MODELS[balance](hidden_size)


def rank_rows(costs: np.ndarray, ranks: int, rank: int) -> np.ndarray:
    """int64[steps, B]: the rows (indexes into each step's rows) rank `rank` takes in
    each step whose rows cost `costs` [steps, ranks x B] (`assign_rows`, step by step)."""
    costs = np.asarray(costs, dtype=np.float64)
    return np.stack([assign_rows(step, ranks)[rank::ranks] for step in costs]).reshape(
        len(costs), costs.shape[1] // ranks)


def assign_rows(costs: np.ndarray, ranks: int) -> np.ndarray:
    """The step's rows for each rank: `order[i * ranks + r]` is the row (an index into
    `costs`, the step's rows in the plan's order) rank r takes as its row i. The rows taken
    costliest first, `ranks` at a time, the costliest of each round to the least loaded
    rank (ties to the lower rank, the earlier row): every rank gets one row a round, so
    B = rows / ranks each. Vectorized per round: B sorts of `ranks` loads."""
    costs = np.asarray(costs, dtype=np.float64)
    rows = len(costs)
    if ranks < 1 or rows % ranks:
        raise ValueError(f"{rows} rows do not split evenly over {ranks} ranks")
    per_rank = rows // ranks
    costliest = np.argsort(-costs, kind="stable").reshape(per_rank, ranks)
    loads = np.zeros(ranks, dtype=np.float64)
    taken = np.empty((ranks, per_rank), dtype=np.int64)
    for round_rows in range(per_rank):
        least_loaded = np.argsort(loads, kind="stable")
        taken[least_loaded, round_rows] = costliest[round_rows]
        loads[least_loaded] += costs[costliest[round_rows]]
    taken.sort(axis=1)  # a rank's rows in the plan's order
    return taken.T.reshape(-1)


def cost_order(costs: np.ndarray, ties: np.ndarray, descending: bool = False) -> np.ndarray:
    """A block's rows in order of cost: `order[i]` is the row at place i, rows of equal
    cost in the order `ties` gives (a seeded permutation of the rows), the costliest first
    where `descending`. Blocks ordered up and down by turns keep the G consecutive rows of
    a step alike in cost across a block's edge too."""
    ties = np.asarray(ties, dtype=np.int64)
    ranked = ties[np.argsort(np.asarray(costs, dtype=np.float64)[ties], kind="stable")]
    return ranked[::-1].copy() if descending else ranked


def rank_loads(costs: np.ndarray, order: np.ndarray | None, ranks: int) -> np.ndarray:
    """float64[ranks]: what each rank computes in a step whose rows (in the plan's order)
    cost `costs`, taken as `order` says (None: the plan's order, row i*ranks + r on rank
    r)."""
    taken = np.asarray(costs, dtype=np.float64)
    if order is not None:
        taken = taken[order]
    return taken.reshape(-1, ranks).sum(axis=0)
