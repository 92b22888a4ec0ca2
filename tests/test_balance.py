"""Balance by attention cost (raypipe.sampling.balance): a step's rows go to ranks B at a
time, every row once, by a pure function of their costs; grouping moves rows only among
the steps of a window; a row's cost is its model's."""

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
    group_steps,
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
@given(steps=st.integers(1, 8), width=st.integers(1, 8), seed=st.integers(0, 1000))
def test_grouping_moves_rows_only_within_the_window_and_sorts_them_into_steps(
        steps, width, seed):
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(0, 2, steps * width)
    order = group_steps(costs, steps, rng.permutation(steps))
    assert sorted(order.tolist()) == list(range(steps * width))
    grouped = costs[order].reshape(steps, width)
    lows, highs = grouped.min(axis=1), grouped.max(axis=1)
    ranked = np.argsort(lows, kind="stable")
    assert (highs[ranked][:-1] <= lows[ranked][1:]).all()  # each step a run of sorted costs


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
        def costs(self, rows, seq_len):
            return np.array([float(row.take.sum()) for row in rows])

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
