"""Feistel permutation and best-fit packing: properties and golden values (no Ray, no torch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.nanochat_reference import nanochat_bestfit_crop
from raypipe.sampling.blocks import whole_shards
from raypipe.sampling.modes import waste_hints
from raypipe.sampling.modes.bestfit import BestFitPlan
from raypipe.sampling.modes.windows import WindowPlan
from raypipe.sampling.pack import PACKINGS, pack, pack_crop, pack_fill, pack_split
from raypipe.sampling.permute import (
    FeistelPermutation,
    GroupedPermutation,
    JoinedOrder,
    WindowedPermutation,
    window_bounds,
)
from raypipe.sampling.plans import (
    LaneOrder,
    PackingReport,
    ShardGroups,
    ShardWindows,
    next_window_blocks,
)

SIZES = [1, 2, 3, 7, 2**8, 2**8 - 1, 2**8 + 1, 2**16, 2**16 - 1, 2**16 + 1, 97, 65521, 131071,
         2**17 + 3]


@pytest.mark.parametrize("n", SIZES)
def test_bijection_and_inverse_exhaustive(n):
    permutation = FeistelPermutation(n, seed=1234, epoch=0)
    values = permutation(np.arange(n))
    assert np.array_equal(np.sort(values), np.arange(n))
    assert np.array_equal(permutation.inverse(values), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63), epoch=st.integers(0, 1000))
def test_bijection_for_any_size_seed_epoch(n, seed, epoch):
    values = FeistelPermutation(n, seed, epoch)(np.arange(n))
    assert np.array_equal(np.sort(values), np.arange(n))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 400), joins=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 300)),
                                             min_size=1, max_size=3),
       seed=st.integers(0, 2**32))
def test_a_joined_order_keeps_what_was_served_and_mixes_the_rest_with_the_joined(n, joins,
                                                                                seed):
    order, count = FeistelPermutation(n, seed, 0, salt=3), n
    for share, added in joins:
        first = int(share * count)
        joined = JoinedOrder(order, first, count + added, seed, 0, salt=4096 + count + added)
        every = joined(np.arange(count + added, dtype=np.int64))
        assert sorted(every.tolist()) == list(range(count + added))
        assert np.array_equal(joined.inverse(every), np.arange(count + added))
        assert np.array_equal(every[:first], order(np.arange(first, dtype=np.int64)))
        unserved = set(order(np.arange(first, count, dtype=np.int64)).tolist())
        assert set(every[first:].tolist()) == unserved | set(range(count, count + added))
        order, count = joined, count + added


def test_seeds_and_epochs_give_different_orders():
    orders = {tuple(FeistelPermutation(1000, seed, epoch)(np.arange(1000)).tolist())
              for seed in (0, 1, 2) for epoch in (0, 1, 2)}
    assert len(orders) == 9


def test_golden_values_never_drift():
    assert FeistelPermutation(10, 1234, 0)(np.arange(10)).tolist() == [5, 0, 8, 3, 9, 7, 6, 1,
                                                                       4, 2]
    assert FeistelPermutation(10, 1234, 1)(np.arange(10)).tolist() == [5, 7, 3, 8, 2, 0, 1, 9,
                                                                       4, 6]
    assert FeistelPermutation(1000003, 7, 3)(np.array([0, 1, 2, 500000, 1000002])).tolist() == [
        187356, 895115, 947987, 688668, 848807]
    assert FeistelPermutation(2**40, 42, 0)(np.array([0, 1, 2**39, 2**40 - 1])).tolist() == [
        428015906396, 947227193611, 536174784409, 402371563822]


def test_scalar_and_range_checks():
    permutation = FeistelPermutation(7, 1)
    assert isinstance(permutation(3), int) and permutation.inverse(permutation(3)) == 3
    with pytest.raises(IndexError):
        permutation(7)
    assert len(FeistelPermutation(0, 1)(np.arange(0))) == 0


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=200),
       capacity=st.integers(2, 257))
def test_crop_packing_rows_are_full_bos_aligned_and_conserve_tokens(lengths, capacity):
    lengths = np.array(lengths, dtype=np.int64)
    ids = np.arange(len(lengths), dtype=np.int64)[::-1].copy()
    packed = pack_crop(ids, lengths[ids], capacity)
    total = int(lengths.sum())
    assert packed.used_tokens + packed.cropped_tokens + packed.dropped_tokens == total
    seen = []
    for row in range(packed.num_rows):
        pieces = packed.row(row)
        doc_ids, starts, take = pieces.documents, pieces.starts, pieces.take
        assert take.sum() == capacity and not starts.any()  # full row, no padding
        assert (take <= lengths[doc_ids]).all() and (take > 0).all()
        # every segment starts at its document's first token (BOS): only prefixes are taken
        seen.extend(doc_ids.tolist())
    assert len(seen) == len(set(seen))  # a document is used at most once
    assert packed.used_tokens == packed.num_rows * capacity


def test_pack_prefers_largest_fit_then_crops_shortest():
    packed = pack_crop(np.arange(4), np.array([6, 5, 3, 9]), 10)
    # row 0: 9 fits first; nothing fits the last token, so the shortest (3) is cropped to 1
    assert packed.row(0).documents.tolist() == [3, 2] and packed.row(0).take.tolist() == [9, 1]
    assert packed.row(0).ends_document.tolist() == [True, False]  # 2 is cropped
    # row 1: 6 fits; 5 does not fit the 4 left and is the shortest: cropped to 4
    assert packed.row(1).documents.tolist() == [0, 1] and packed.row(1).take.tolist() == [6, 4]
    assert packed.num_rows == 2 and packed.cropped_tokens == 2 + 1


def test_crop_packing_crops_no_more_than_nanochat():
    lengths = (np.random.default_rng(0).lognormal(5.5, 1.0, 20000) + 2).astype(np.int64)
    plan = BestFitPlan(lengths, 2048, seed=1, epoch=0, packing="crop")
    order = np.concatenate([plan.block_documents_ids(b) for b in range(plan.num_blocks)])
    reference = nanochat_bestfit_crop(lengths[order], 2049)
    assert plan.report().cropped_tokens <= reference["cropped"]


def test_crop_plan_rows_cover_blocks_once():
    lengths = np.random.default_rng(3).integers(2, 400, 3000)
    plan = BestFitPlan(lengths, 255, seed=5, epoch=2, block_documents=500, packing="crop")
    rows = plan.rows(np.arange(plan.size))
    assert sorted(r[0] for r in rows) == list(range(plan.size))
    used_docs = np.concatenate([row.documents for _, row in rows])
    assert len(used_docs) == len(set(used_docs.tolist()))


def assert_every_token_once(packed, lengths, capacity):
    """The rows' segments tile every document exactly: each token in one row, once."""
    covered = {}
    for row in range(packed.num_rows):
        pieces = packed.row(row)
        doc_ids, starts, take = pieces.documents, pieces.starts, pieces.take
        assert 0 < take.sum() <= capacity and (take > 0).all()
        assert (pieces.ends_document == (starts + take == lengths[doc_ids])).all()
        for doc, start, count in zip(doc_ids.tolist(), starts.tolist(), take.tolist(),
                                     strict=True):
            covered.setdefault(doc, []).append((start, count))
    for doc, length in enumerate(lengths.tolist()):
        pieces = sorted(covered.pop(doc))
        assert pieces[0][0] == 0 and sum(c for _, c in pieces) == length
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:], strict=False))
    assert not covered


@settings(max_examples=120, deadline=None)
@given(lengths=st.lists(st.integers(1, 1000), min_size=1, max_size=300),
       capacity=st.integers(2, 257))
def test_split_packing_places_every_token_once_and_pads_the_rest(lengths, capacity):
    lengths = np.array(lengths, dtype=np.int64)
    ids = np.arange(len(lengths), dtype=np.int64)
    packed = pack_split(ids, lengths, capacity)
    assert_every_token_once(packed, lengths, capacity)
    total = int(lengths.sum())
    assert packed.used_tokens == total and packed.cropped_tokens == packed.dropped_tokens == 0
    assert packed.padded_tokens == packed.num_rows * capacity - total
    for row in range(packed.num_rows):  # a piece that does not start its document: alone
        starts = packed.row(row).starts
        assert starts.size == 1 or not starts.any()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 100), min_size=1, max_size=200))
def test_best_fit_decreasing_puts_each_piece_in_the_tightest_open_row(sizes):
    capacity = 100
    lengths = np.array(sorted(sizes, reverse=True), dtype=np.int64)
    packed = pack_split(np.arange(len(lengths)), lengths, capacity)
    rooms: dict[int, int] = {}
    row_of = {}
    for row in range(packed.num_rows):
        for doc in packed.row(row).documents.tolist():
            row_of[doc] = row
    for doc, size in enumerate(lengths.tolist()):  # replay: the tightest fit, else a new row
        fitting = [r for r, room in rooms.items() if room >= size]
        expected = min(fitting, key=lambda r: (rooms[r], r)) if fitting else len(rooms)
        assert row_of[doc] == expected
        rooms[expected] = rooms.get(expected, capacity) - size


@pytest.mark.parametrize("median", [50, 400])  # short documents, long-tailed documents
def test_split_packing_pads_under_half_a_percent_of_long_tailed_corpora(median):
    rng = np.random.default_rng(7)
    lengths = (rng.lognormal(np.log(median), 1.5, 60000) + 2).astype(np.int64)
    for seq_len in (512, 2048, 8192):
        plan = BestFitPlan(lengths, seq_len, seed=1, epoch=0, packing="split")
        report = plan.report()
        assert report.used_tokens == report.total_tokens
        assert report.padding_fraction < 0.005, (seq_len, plan.block_documents, report)


def corpus_lengths(kind: str, capacity: int, count: int = 20000) -> np.ndarray:
    """Document lengths (tokens) of the four corpus shapes the fill packing is measured on."""
    rng = np.random.default_rng(11)
    if kind == "long-tailed":
        return (rng.lognormal(np.log(0.2 * capacity), 1.5, count) + 2).astype(np.int64)
    if kind == "narrow":  # every document 0.55-0.8 of a row: two never share one
        return rng.integers(int(0.55 * capacity), int(0.8 * capacity) + 1, count)
    if kind == "bimodal":
        short = rng.integers(capacity // 40, capacity // 10, count)
        return np.where(rng.random(count) < 0.5, short,
                        rng.integers(int(0.7 * capacity), int(0.95 * capacity), count))
    return rng.integers(1, 2 * capacity, count)  # uniform


def concatenation_cuts(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Cuts per document when the documents are concatenated and cut into rows."""
    ends = np.cumsum(lengths)
    return (ends - 1) // capacity - (ends - lengths) // capacity


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 1000), min_size=1, max_size=300),
       capacity=st.integers(2, 257))
def test_fill_packing_places_every_token_once_in_full_rows(lengths, capacity):
    lengths = np.array(lengths, dtype=np.int64)
    packed = pack_fill(np.arange(len(lengths), dtype=np.int64), lengths, capacity)
    assert_every_token_once(packed, lengths, capacity)
    total = int(lengths.sum())
    assert packed.num_rows == -(-total // capacity)  # rows follow from the token sum
    assert packed.used_tokens == total and packed.padded_tokens < capacity


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 700), min_size=1, max_size=250),
       capacity=st.integers(2, 257), packing=st.sampled_from(PACKINGS),
       separators=st.sampled_from([(True, False), (False, True), (True, True)]))
def test_every_join_inside_a_packed_row_is_visible_to_a_reader_of_bos_and_eos(
        lengths, capacity, packing, separators):
    """Documents start with BOS and/or end with EOS. In every row, wherever a piece follows
    a piece it does not continue truly (the first does not end its document, or the next
    does not start its own), a separator stands between them: the first ends with EOS or
    the next starts with BOS. So no separator position is ever needed."""
    bos, eos = separators
    lengths = np.array(lengths, dtype=np.int64)
    packed = pack(packing, np.arange(len(lengths), dtype=np.int64), lengths, capacity,
                  "bos" if bos else "eos")
    for row in range(packed.num_rows):
        pieces = packed.row(row)
        opens = pieces.starts_document & bos  # the piece's first token is a BOS
        closes = pieces.ends_document & eos  # its last token is an EOS
        visible = closes[:-1] | opens[1:]
        assert (visible | pieces.true_joins).all(), (row, pieces)
        assert visible.all() or not (bos or eos)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=400),
       seq_len=st.integers(1, 600), block=st.integers(1, 80), seed=st.integers(0, 2**32))
def test_fill_plan_row_counts_from_token_sums_match_the_packed_blocks(lengths, seq_len, block,
                                                                      seed):
    lengths = np.array(lengths, dtype=np.int64)
    plan = BestFitPlan(lengths, seq_len, seed=seed, epoch=1, block_documents=block)
    for index in range(plan.num_blocks):
        rows = int(plan.row_offsets[index + 1] - plan.row_offsets[index])
        assert plan.pack(index).num_rows == rows
    report = plan.report()
    assert report.used_tokens == report.total_tokens == int(lengths.sum())
    assert report.padded_tokens == plan.size * (seq_len + 1) - report.total_tokens


@pytest.mark.parametrize("kind", ["long-tailed", "narrow", "bimodal", "uniform"])
@pytest.mark.parametrize("seq_len", [512, 2048, 8192])
def test_fill_packing_pads_under_one_percent_and_cuts_fewer_documents_than_concatenation(
        kind, seq_len):
    lengths = corpus_lengths(kind, seq_len + 1)
    plan = BestFitPlan(lengths, seq_len, seed=1, epoch=0)
    report = plan.report()
    assert report.used_tokens == report.total_tokens and report.untrained_tokens == 0
    assert report.padding_fraction <= 0.01, report
    pieces = np.concatenate([plan.pack(block).doc_ids for block in range(plan.num_blocks)])
    cut_documents = np.count_nonzero(np.bincount(pieces, minlength=len(lengths)) > 1)
    order = np.concatenate([plan.block_documents_ids(b) for b in range(plan.num_blocks)])
    concatenated = concatenation_cuts(lengths[order], seq_len + 1)
    assert cut_documents <= np.count_nonzero(concatenated)
    assert pieces.size - len(lengths) <= concatenated.sum()  # cuts


def test_split_packing_pads_a_third_of_rows_when_lengths_sit_between_half_and_one_row():
    lengths = corpus_lengths("narrow", 2049)
    split = BestFitPlan(lengths, 2048, 1, 0, packing="split").report()
    fill = BestFitPlan(lengths, 2048, 1, 0).report()
    assert split.padding_fraction > 0.25 and fill.padding_fraction < 0.001
    assert split.used_tokens == fill.used_tokens == split.total_tokens


def warning_of(caplog, report: PackingReport, mode: str, packing: str | None) -> str:
    caplog.clear()
    with caplog.at_level("WARNING", logger="raypipe"):
        warned = report.warn_if_wasteful("what", waste_hints(mode, packing))
    messages = [r.getMessage() for r in caplog.records]
    assert warned == bool(messages) and len(messages) <= 1
    return messages[0] if messages else ""


def test_waste_warning_is_silent_when_nothing_is_wasted(caplog):
    lengths = corpus_lengths("narrow", 512)
    assert warning_of(caplog, BestFitPlan(lengths, 511, 1, 0).report(), "bestfit", "fill") == ""


def test_waste_warning_names_padding_and_a_packing_that_fills_rows(caplog):
    lengths = corpus_lengths("narrow", 512)
    message = warning_of(caplog, BestFitPlan(lengths, 511, 1, 0, packing="split").report(),
                         "bestfit", "split")
    assert "of the positions are padding" in message and "not trained" not in message
    assert "hint: packing 'fill'" in message


def test_waste_warning_names_untrained_tokens_and_a_packing_that_keeps_them(caplog):
    lengths = (np.random.default_rng(7).lognormal(6.0, 1.5, 5000) + 2).astype(np.int64)
    message = warning_of(caplog, BestFitPlan(lengths, 511, 1, 0, packing="crop").report(),
                         "bestfit", "crop")
    assert "of the tokens are not trained" in message and "padding" not in message
    assert "hint: packing 'fill'" in message


@pytest.mark.parametrize("mode,packing", [("bestfit", p) for p in PACKINGS]
                         + [("documents", None), ("windows", None), ("batches", "fill"),
                            ("batches", "split"), ("batches", "crop"),
                            ("batches", "concat")])
def test_waste_hint_never_names_what_is_running(caplog, mode, packing):
    report = PackingReport(10, 50, 20, 40, 30, 100)  # every kind of waste past 5%
    message = warning_of(caplog, report, mode, packing)
    hints = [part.split("hint: ", 1)[1] for part in message.split("; ") if "hint: " in part]
    assert len(hints) == 2
    for hint in hints:
        assert f"packing '{packing}'" not in hint and f"mode '{mode}'" not in hint


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(0, 2**32),
       st.integers(0, 3))
def test_grouped_permutation_is_an_invertible_bijection_that_visits_one_group_at_a_time(
        sizes, seed, epoch):
    permutation = GroupedPermutation(np.array(sizes), seed, epoch, salt=3)
    total = sum(sizes)
    ids = permutation(np.arange(total, dtype=np.int64))
    assert sorted(ids.tolist()) == list(range(total))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    groups = np.searchsorted(starts, ids, side="right") - 1
    changes = int(np.count_nonzero(np.diff(groups))) if total else 0
    assert changes <= max(0, np.count_nonzero(sizes) - 1), "a group was left and re-entered"
    assert np.array_equal(permutation.inverse(ids), np.arange(total))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(1, 9),
       st.integers(0, 2**32), st.integers(0, 3))
def test_grouped_batch_blocks_are_a_bijection_one_group_at_a_time_blocks_in_file_order(
        sizes, block, seed, epoch):
    """Batches served a group of shards at a time: every batch once, a group never left
    and re-entered, a block's batches consecutive and in file order, a group's partial
    block after its full ones."""
    from raypipe.sampling.modes.batches import GroupedBlocks

    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(starts[-1])
    order = GroupedBlocks(starts, block, seed, epoch)
    ids = order(np.arange(total, dtype=np.int64))
    assert sorted(ids.tolist()) == list(range(total))
    assert np.array_equal(order.inverse(ids), np.arange(total))
    groups = np.searchsorted(starts, ids, side="right") - 1
    changes = int(np.count_nonzero(np.diff(groups))) if total else 0
    assert changes <= max(0, np.count_nonzero(sizes) - 1), "a group was left and re-entered"
    for group in np.unique(groups).tolist():
        served = ids[groups == group] - starts[group]  # the group's batches, as served
        full = sizes[group] // block * block
        assert served[full:].tolist() == list(range(full, sizes[group]))  # partial: last
        for first in range(0, full, block):
            run = served[first:first + block]
            assert run[0] % block == 0 and run.tolist() == list(range(run[0], run[0] + block))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30), st.integers(1, 8),
       st.integers(0, 2**63), st.integers(0, 5), st.integers(0, 5))
def test_windowed_permutation_is_a_bijection_reading_one_window_of_shards_at_a_time(
        sizes, window, seed, epoch, lanes):
    counts = np.array(sizes)
    order = WindowedPermutation(counts, window, seed, epoch, salt=3, lanes=lanes)
    total = int(counts.sum())
    ids = order(np.arange(total, dtype=np.int64))
    assert sorted(ids.tolist()) == list(range(total))
    assert np.array_equal(order.inverse(ids), np.arange(total))
    starts = np.concatenate([[0], np.cumsum(counts)])
    shard_of = np.searchsorted(starts, ids, side="right") - 1
    for number in range(order.num_windows):  # window w's positions read window w's shards
        first, stop = order.window_starts[number], order.window_starts[number + 1]
        assert set(shard_of[first:stop].tolist()) <= set(order.window_block_ids(number).tolist())
        ahead = next_window_blocks(order, int(first)) if stop > first else None
        if ahead is not None and number + 1 < order.num_windows:
            assert ahead.tolist() == order.window_block_ids(number + 1).tolist()
    assert sorted(order.block_order.tolist()) == list(range(len(sizes)))


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=8), st.integers(1, 4),
       st.integers(1, 3), st.booleans())
def test_lane_order_is_a_bijection_and_a_rank_reads_its_lane_until_the_leftovers(
        sizes, times, ranks_per_lane, nearby):
    """Lanes read by k consecutive ranks each: rank r of a world of lanes x k x times
    reads lane (r mod lanes x k) // k alone until the leftovers (k = 1: r mod lanes), its
    k ranks in turn through the lane's observations."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    lanes = LaneOrder(bounds, nearby, ranks_per_lane)
    total = int(bounds[-1])
    observations = lanes(np.arange(total, dtype=np.int64))
    assert sorted(observations.tolist()) == list(range(total))
    cycle = len(sizes) * ranks_per_lane
    world = cycle * times  # a world size the lanes' ranks divide
    lane_of = np.searchsorted(bounds, observations, side="right") - 1
    assert lanes.even >= len(sizes) * (min(sizes) - ranks_per_lane + 1)
    for rank in range(world):
        mine = np.arange(rank, lanes.even, world)
        assert set(lane_of[mine].tolist()) <= {rank % cycle // ranks_per_lane}
    for lane in range(len(sizes)):  # its ranks in turn: the lane in order, side by side
        read = observations[:lanes.even][lane_of[:lanes.even] == lane]
        assert np.array_equal(read, bounds[lane] + np.arange(read.size))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 500), st.integers(1, 20), st.integers(1, 40))
def test_windows_laid_out_for_lanes_divide_evenly_and_fit_the_window(blocks, window, lanes):
    bounds = window_bounds(blocks, window, lanes)
    sizes = np.diff(bounds)
    assert bounds[0] == 0 and bounds[-1] == blocks
    assert len(sizes) % lanes == 0, "lanes of whole windows would differ by a window"
    assert sizes.max() <= window, "a window over the budget's blocks"
    assert sizes.max() - sizes.min() <= 1
    lane_blocks = sizes.reshape(lanes, -1).sum(axis=1)  # lanes of whole windows
    assert lane_blocks.max() - lane_blocks.min() <= 1, "lanes of unequal blocks"
    assert len(sizes) // lanes == max(1, -(-blocks // (lanes * window))), \
        "more windows than the budget needs"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 14), min_size=2, max_size=9), st.integers(1, 3),
       st.booleans())
def test_lane_order_nearby_is_a_bijection_each_lane_serving_a_prefix(sizes, ranks_per_lane,
                                                                      nearby):
    """At every position, shared by k ranks a lane or not, nearby or spread: each lane
    has served a prefix of its observations, and `served` counts it."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    lanes = LaneOrder(bounds, nearby, ranks_per_lane)
    total = int(bounds[-1])
    observations = lanes(np.arange(total, dtype=np.int64))
    assert sorted(observations.tolist()) == list(range(total))
    for position in range(total + 1):
        served = lanes.served(position)
        read = observations[:position]
        for lane in range(len(sizes)):
            mine = np.sort(read[(read >= bounds[lane]) & (read < bounds[lane + 1])])
            assert np.array_equal(mine, bounds[lane] + np.arange(mine.size)), "no prefix"
            assert served[lane] == mine.size


@pytest.mark.parametrize("ranks_per_lane", [1, 4])
def test_lane_order_nearby_reads_each_lanes_rest_on_ranks_beside_it(ranks_per_lane):
    """Lanes one block apart (64 ranks, 8 a node, each lane read by k of them): nearby, a
    lane's rest is read by the ranks of a lane at most two away, so on one node or two;
    spread, by every node."""
    rng = np.random.default_rng(7)
    world, per_node = 64, 8
    lanes = world // ranks_per_lane
    sizes = 1000 + 50 * (np.arange(lanes) % 2) + rng.integers(0, 5, lanes)
    bounds = np.concatenate([[0], np.cumsum(sizes)])

    def nodes_per_lane(order: LaneOrder) -> tuple[int, int]:
        positions = np.arange(order.even, int(bounds[-1]), dtype=np.int64)
        lane = np.searchsorted(bounds, order(positions), side="right") - 1
        rank = positions % world
        nodes = {(int(a), int(b) // per_node) for a, b in zip(lane, rank, strict=True)}
        counts = np.bincount([a for a, _ in nodes], minlength=lanes)
        return int(counts.max()), int(np.abs(lane - rank // ranks_per_lane).max())

    most_nodes, farthest = nodes_per_lane(LaneOrder(bounds, True, ranks_per_lane))
    assert most_nodes <= 2 and farthest <= 2
    most_nodes, _ = nodes_per_lane(LaneOrder(bounds, False, ranks_per_lane))
    assert most_nodes == world // per_node


def test_windowed_bestfit_ranks_read_only_their_lanes_shards_before_the_leftovers():
    rng = np.random.default_rng(4)
    shard_documents = np.full(16, 40)
    lengths = rng.integers(5, 60, int(shard_documents.sum()))
    windows = ShardWindows(whole_shards(shard_documents), 2, 2)
    plan = BestFitPlan(lengths, 31, seed=1, epoch=0, block_documents=8, groups=windows)
    order = plan.document_order
    starts = np.concatenate([[0], np.cumsum(shard_documents)])
    halves = [set(order.block_order[:8].tolist()), set(order.block_order[8:].tolist())]
    world = 4
    for rank in range(world):
        positions = np.arange(rank, plan.lanes.even, world)
        documents = np.concatenate([row.documents for _, row in plan.rows(positions)])
        shards = set((np.searchsorted(starts, documents, side="right") - 1).tolist())
        assert shards <= halves[rank % 2], f"rank {rank} left its lane"
    every = np.concatenate([row.documents for _, row in plan.rows(np.arange(plan.size))])
    assert set(every.tolist()) == set(range(lengths.size))  # every document, in pieces


def test_windowed_shard_order_draws_every_shard_into_every_window_alike():
    """Over seeds, shard s lands in window w with probability 1/windows (not by its index:
    neighbouring shards are no likelier to share a window than any two)."""
    shards, window, seeds = 64, 8, 400
    hits = np.zeros((shards, shards // window))
    together = 0
    for seed in range(seeds):
        order = WindowedPermutation(np.ones(shards, dtype=np.int64), window, seed)
        windows = np.empty(shards, dtype=np.int64)
        windows[order.block_order] = np.arange(shards) // window
        hits[np.arange(shards), windows] += 1
        together += int(windows[0] == windows[1])
    expected = seeds / (shards // window)
    assert np.abs(hits - expected).max() < 5 * np.sqrt(expected)  # ~5 sigma
    assert together / seeds < 2 * (window - 1) / (shards - 1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=10), st.integers(1, 4),
       st.integers(2, 40), st.integers(0, 1000))
def test_shard_local_windows_stay_inside_their_group(shard_tokens, group_shards, seq_len,
                                                    seed):
    tokens = np.array(shard_tokens)
    groups = ShardGroups.of(tokens, np.ones_like(tokens), group_shards)
    plan = WindowPlan(int(tokens.sum()), seq_len, seed, 0, groups)
    _, starts = plan.window_starts(np.arange(plan.size, dtype=np.int64))
    assert len(set(starts.tolist())) == plan.size
    group_of_first = np.searchsorted(groups.tokens, starts, side="right") - 1
    group_of_last = np.searchsorted(groups.tokens, starts + seq_len, side="right") - 1
    assert np.array_equal(group_of_first, group_of_last), "a window crosses its group"
    report = plan.report()
    assert report.used_tokens + report.dropped_tokens == tokens.sum()


def targets_of(block) -> list[tuple[int, int]]:
    """(document, token) of every target a row's pieces train: each token after its piece's
    first (a target from the piece's own previous token)."""
    return [(int(doc), int(start) + offset)
            for doc, start, take in zip(block.doc_ids, block.starts, block.take, strict=True)
            for offset in range(1, int(take))]


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 700), min_size=1, max_size=200),
       capacity=st.integers(2, 256), separator=st.sampled_from(["bos", "eos"]))
def test_overlong_split_trains_every_target_of_every_document_once(lengths, capacity,
                                                                   separator):
    """Pieces of a document longer than a row overlap by one token, so every token but a
    document's first is a target inside some piece exactly once; a document that fits a
    row stays one piece; rows stay within capacity; the repeated tokens are counted."""
    lengths_array = np.array(lengths, dtype=np.int64)
    doc_ids = np.arange(len(lengths)) * 7 + 3  # plan numbering, not block indices
    block = pack("split", doc_ids, lengths_array, capacity, separator, overlong="split")
    assert sorted(targets_of(block)) == sorted(
        (int(doc), token) for doc, length in zip(doc_ids, lengths, strict=True)
        for token in range(1, length))
    pieces = np.bincount(np.searchsorted(doc_ids, block.doc_ids), minlength=len(lengths))
    assert all(pieces[lengths_array <= capacity] == 1)
    widths = np.add.reduceat(block.take, block.row_offsets[:-1]) if block.take.size else []
    assert all(0 < width <= capacity for width in widths)
    by_doc = dict(zip(doc_ids.tolist(), lengths, strict=True))
    assert np.array_equal(block.ends_document,
                          block.starts + block.take == [by_doc[d] for d in block.doc_ids])
    assert block.used_tokens == sum(lengths)
    assert block.repeated_tokens == int((pieces - 1).sum())
    assert block.used_tokens + block.repeated_tokens + block.padded_tokens == \
        block.num_rows * capacity


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 700), min_size=1, max_size=200),
       capacity=st.integers(2, 256), overlong=st.sampled_from(["truncate", "drop"]))
def test_overlong_truncate_keeps_a_first_row_and_drop_leaves_out_counting_the_rest(
        lengths, capacity, overlong):
    lengths_array = np.array(lengths, dtype=np.int64)
    block = pack("split", np.arange(len(lengths)), lengths_array, capacity, "bos",
                 overlong=overlong)
    over = lengths_array > capacity
    placed = np.bincount(block.doc_ids, weights=block.take, minlength=len(lengths))
    kept = np.where(over, capacity if overlong == "truncate" else 0, lengths_array)
    assert np.array_equal(placed, kept)
    assert not block.ends_document[over[block.doc_ids]].any()  # never joined onward
    lost = int((lengths_array - kept).sum())
    assert (block.cropped_tokens, block.dropped_tokens) == (
        (lost, 0) if overlong == "truncate" else (0, lost))
    assert block.used_tokens + lost == sum(lengths)


def test_overlong_is_a_rule_of_split_packing_only():
    from raypipe.errors import ConfigError
    from raypipe.sampling.modes import PlanSpec

    with pytest.raises(ValueError, match="only 'cut' under 'fill'"):
        pack("fill", np.arange(2), np.array([5, 9]), 4, overlong="split")
    with pytest.raises(ConfigError, match="overlong='drop' is a rule of split packing"):
        PlanSpec.of("bestfit", 8, packing="fill", overlong="drop")
    assert PlanSpec.of("bestfit", 8).for_data(True).knobs.overlong == "split"
    assert PlanSpec.of("bestfit", 8).for_data(False).knobs.overlong == "cut"


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=10, max_size=400),
       cuts=st.lists(st.integers(0, 400), min_size=2, max_size=6), seed=st.integers(0, 9),
       excluded=st.lists(st.integers(0, 399), max_size=40))
def test_a_plan_of_some_runs_of_the_order_sums_its_blocks_alike_either_way(
        lengths, cuts, seed, excluded):
    """A lane's rest of an epoch packs runs of the windowed order; its block token sums
    from its own runs' documents (gathered through the order) equal those of the pass
    over every document's length, with documents excluded too."""
    import raypipe.sampling.modes.bestfit as bestfit
    from raypipe.sampling.modes.bestfit import replace_ranges

    lengths = np.array(lengths, dtype=np.int64)
    count = lengths.size
    shards = np.diff(np.append(np.arange(0, count, 7), count))
    excluded = np.unique(np.array([pick % count for pick in excluded], dtype=np.int64))
    plan = BestFitPlan(lengths, 24, seed, 0, 5, "fill",
                       ShardWindows(whole_shards(shards), 2), excluded=excluded)
    bounds = sorted({min(cut, count) for cut in cuts})
    runs = np.array([[first, end] for first, end in zip(bounds[::2], bounds[1::2],
                                                        strict=False) if first < end]
                    or [[0, 0]], dtype=np.int64)
    part = replace_ranges(plan, runs)
    gathered = part._gathered_sums()
    share, bestfit.GATHER_SHARE = bestfit.GATHER_SHARE, 0
    try:
        passed = part.block_token_sums()
    finally:
        bestfit.GATHER_SHARE = share
    assert np.array_equal(gathered, passed)
    assert part.num_blocks == 0 or (part.block_starts >= runs[0, 0]).all()
