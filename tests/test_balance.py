"""Balance by attention cost (raypipe.sampling.balance): a step's rows go to ranks B at a
time, every row once, by a pure function of their costs; a block's rows ordered by cost;
a row's cost is its model's; the loaders (one dataset, a mixture) serve each step's rows
under a balance, moved between ranks only."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.errors import ConfigError, StateError
from raypipe.loader import open_loader
from raypipe.sampling.balance import (
    COST_MODELS,
    AttentionCost,
    assign_rows,
    balance_names,
    cost_order,
    costs_of,
    rank_loads,
    register_cost_model,
)
from raypipe.sampling.modes import PlanSpec
from raypipe.sampling.pack import pack_fill


@settings(max_examples=80, deadline=None)
@given(ranks=st.integers(1, 8), per_rank=st.integers(1, 6), seed=st.integers(0, 1000))
def test_every_rank_takes_exactly_its_rows_and_every_row_is_taken_once(ranks, per_rank, seed):
    costs = np.random.default_rng(seed).lognormal(0, 2, ranks * per_rank)
    order = assign_rows(costs, ranks)
    assert sorted(order.tolist()) == list(range(ranks * per_rank))
    assert np.array_equal(assign_rows(costs.copy(), ranks), order)  # alike on every rank


def test_assigned_rows_even_out_a_step_the_plan_order_leaves_uneven():
    costs = np.array([9.0, 8.0, 1.0, 1.0, 5.0, 4.0, 1.0, 1.0])  # ranks 0, 1 of 2: rows alternate
    assert rank_loads(costs, None, 2).tolist() == [16.0, 14.0]
    assert rank_loads(costs, assign_rows(costs, 2), 2).tolist() == [15.0, 15.0]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 60), levels=st.integers(1, 6), seed=st.integers(0, 1000),
       descending=st.booleans())
def test_a_block_by_cost_is_a_permutation_sorted_by_cost_with_ties_in_the_seeded_order(
        rows, levels, seed, descending):
    rng = np.random.default_rng(seed)
    costs = rng.integers(0, levels, rows).astype(np.float64)  # many ties
    ties = rng.permutation(rows)
    order = cost_order(costs, ties, descending)
    assert sorted(order.tolist()) == list(range(rows))
    placed = costs[order]
    assert (np.diff(placed) <= 0).all() if descending else (np.diff(placed) >= 0).all()
    rank_in_ties = np.argsort(ties)
    for level in np.unique(costs):
        equal = rank_in_ties[order[placed == level]]
        assert (np.diff(equal) < 0).all() if descending else (np.diff(equal) > 0).all()


def test_a_rows_attention_cost_is_linear_in_its_tokens_plus_the_squares_of_its_pieces():
    lengths = np.array([3000, 500, 9000, 120, 40_000], dtype=np.int64)
    packed = pack_fill(np.arange(len(lengths)), lengths, 8193)
    cost = AttentionCost.of_model(1024)
    found = cost.row_costs(packed.row_offsets, packed.take, 8192)
    for row in range(packed.num_rows):
        pieces = packed.row(row).take.astype(np.float64)
        assert found[row] == 6 * 1024 * 8192 + (pieces ** 2).sum()


# ----- the loader under balance="attention" (no Ray) --------------------------------------
WORLD, T, B = 4, 256, 2
BALANCED = {"balance": "attention", "balance_hidden": 1}  # attention dominates at T=256


def served_steps(path, knobs: dict, steps: int) -> list[tuple[set, np.ndarray]]:
    """Per global step: the rows every rank took (observation keys), and what each rank
    computes, the squares of its batch's sequences (cu_seqlens) summed."""
    loaders = [open_loader(path, T, B, rank=rank, world_size=WORLD, seed=3, **knobs)
               for rank in range(WORLD)]
    taken = [list(itertools.islice(((rows_of(batch), sequence_squares(batch))
                                    for batch in loader), steps)) for loader in loaders]
    return [(set().union(*(taken[rank][step][0] for rank in range(WORLD))),
             np.array([taken[rank][step][1] for rank in range(WORLD)]))
            for step in range(steps)]


def rows_of(batch) -> set:
    if batch.source_ids is not None:
        return set(zip(batch.source_ids.tolist(), batch.positions.tolist(), strict=True))
    return set(batch.observation_ids.tolist())


def sequence_squares(batch) -> float:
    lengths = np.diff(batch.cu_seqlens.numpy()).astype(np.float64)
    return float((lengths ** 2).sum())


@pytest.mark.parametrize("mixture", [False, True], ids=["one-dataset", "mixture"])
def test_balanced_steps_hold_the_same_rows_and_their_slowest_rank_computes_less(
        token_dataset, rich_dataset, mixture):
    path = ({"web": str(token_dataset), "code": str(rich_dataset)} if mixture
            else token_dataset)
    plain, balanced = (served_steps(path, knobs, 24) for knobs in ({}, BALANCED))
    assert [rows for rows, _ in balanced] == [rows for rows, _ in plain]
    moved = sum(not np.array_equal(before, after)
                for (_, before), (_, after) in zip(plain, balanced, strict=True))
    assert moved, "no step moved a row between ranks"
    slowest = [sum(loads.max() for _, loads in steps) for steps in (plain, balanced)]
    assert slowest[1] < slowest[0], slowest


def test_a_balance_the_mode_cannot_serve_or_nobody_registered_is_refused_naming_it():
    with pytest.raises(ConfigError, match="pre-formed batch"):
        PlanSpec.of("batches", 32, balance="attention")
    with pytest.raises(ConfigError, match="'tokens' not among"):
        PlanSpec.of("bestfit", 32, balance="tokens")


def test_a_registered_cost_model_is_a_balance_the_loader_takes(token_dataset):
    class Tokens:
        def row_costs(self, row_offsets, take, seq_len):
            sums = np.concatenate([[0], np.cumsum(take)])
            return (sums[row_offsets[1:]] - sums[row_offsets[:-1]]).astype(np.float64)

    register_cost_model("tokens", lambda hidden: Tokens())
    try:
        assert "tokens" in balance_names()
        loader = open_loader(token_dataset, T, B, rank=1, world_size=2, balance="tokens")
        assert loader.state_dict()["knobs"]["balance"] == "tokens"
        assert next(iter(loader)).inputs.shape == (B, T)
    finally:
        COST_MODELS.pop("tokens")


def test_a_state_saved_under_one_balance_is_refused_under_another(token_dataset):
    loader = open_loader(token_dataset, T, B, **BALANCED)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(StateError, match="balance"):
        open_loader(token_dataset, T, B).load_state_dict(state)


def test_a_block_ordered_by_cost_evens_out_steps_of_one_row_a_rank(token_dataset):
    """One row a rank: nothing to move within a step; a block's rows in order of cost
    make a step's rows alike, so the slowest rank waits less."""
    def spread(knobs):
        loaders = [open_loader(token_dataset, T, 1, rank=rank, world_size=WORLD, seed=3,
                               block_documents=200, **knobs) for rank in range(WORLD)]
        loads = np.array([[sequence_squares(batch) for batch in itertools.islice(loader, 24)]
                          for loader in loaders])  # [rank, step]
        return float((loads.max(axis=0) / loads.mean(axis=0)).mean())

    assert spread({**BALANCED, "block_order": "by_cost"}) < spread(BALANCED)


@pytest.mark.parametrize("knobs", [{"mode": "bestfit"}, {"mode": "bestfit", "packing": "split"},
                                   {"mode": "documents"}, {"mode": "windows"},
                                   {"mode": "windows", "split": "train",
                                    "validation_fraction": 0.2},
                                   {"mode": "bestfit", "block_order": "by_cost",
                                    "block_documents": 40}],
                         ids=["bestfit", "bestfit-split", "documents", "windows",
                              "windows-train-split", "bestfit-by-cost"])
def test_a_modes_row_costs_from_its_plan_equal_the_costs_of_what_its_rows_hold(
        rich_dataset, knobs):
    """The fast path each mode answers costs by (its plan, no RowPieces) says what costing
    `segments` (what trace shows) says, for rows anywhere in the epoch, a stream's
    windows across shards and documents included."""
    loader = open_loader(rich_dataset, 48, 2, seed=4, balance="attention", **knobs)
    filler = loader.run.planned.filler(0)
    model = AttentionCost.of_model(8)
    size = loader.plan(0).size
    positions = np.random.default_rng(1).permutation(size)[:min(size, 300)][None, :]
    fast = filler.row_costs(positions, model, 48)
    assert np.array_equal(fast, costs_of(model, filler.segments(positions), 48))


def test_row_costs_of_the_rest_of_an_epoch_planned_again_equal_those_of_its_rows(
        rich_dataset):
    """After an exclusion mid-epoch the plan is a head of leftover pieces packed again and
    a tail: costs from it match costing its rows."""
    loader = open_loader(rich_dataset, 48, 2, seed=4, balance="attention",
                         exclude=[3, 5, 8])
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    batches.close()
    fresh = open_loader(rich_dataset, 48, 2, seed=4, balance="attention", exclude=[11, 12])
    fresh.load_state_dict(loader.state_dict())
    cursor = fresh.run.planned.schedule.phases_at(fresh.run.cursor())
    assert len(cursor.phases) > 1  # the exclusion began a phase: a continued plan
    filler = fresh.run.planned.filler(cursor.epoch, phases=cursor.phases)
    assert getattr(filler.plan, "head_rows", 0) > 0
    model = AttentionCost.of_model(8)
    positions = np.arange(min(filler.plan.size, 200))[None, :]
    assert np.array_equal(filler.row_costs(positions, model, 48),
                          costs_of(model, filler.segments(positions), 48))
