"""Balance by attention cost (raypipe.sampling.balance): a step's rows go to ranks B at a
time, every row once, by a pure function of their costs; grouping moves rows only among
the steps of a window; a row's cost is its model's."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.sampling.balance import AttentionCost, assign_rows, group_steps, rank_loads
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
