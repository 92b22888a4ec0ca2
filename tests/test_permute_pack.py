"""Feistel permutation and best-fit packing: properties and golden values (no Ray, no torch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.nanochat_reference import nanochat_bestfit_crop
from raypipe.sampling.pack import pack_block
from raypipe.sampling.permute import FeistelPermutation
from raypipe.sampling.plans import BestFitPlan

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
def test_pack_block_rows_are_full_bos_aligned_and_conserve_tokens(lengths, capacity):
    lengths = np.array(lengths, dtype=np.int64)
    ids = np.arange(len(lengths), dtype=np.int64)[::-1].copy()
    packed = pack_block(ids, lengths[ids], capacity)
    total = int(lengths.sum())
    assert packed.used_tokens + packed.cropped_tokens + packed.dropped_tokens == total
    seen = []
    for row in range(packed.num_rows):
        doc_ids, take = packed.row(row)
        assert take.sum() == capacity  # full row, no padding
        assert (take <= lengths[doc_ids]).all() and (take > 0).all()
        # every segment starts at its document's first token (BOS): only prefixes are taken
        seen.extend(doc_ids.tolist())
    assert len(seen) == len(set(seen))  # a document is used at most once
    assert packed.used_tokens == packed.num_rows * capacity


def test_pack_prefers_largest_fit_then_crops_shortest():
    packed = pack_block(np.arange(4), np.array([6, 5, 3, 9]), 10)
    # row 0: 9 fits first; nothing fits the last token, so the shortest (3) is cropped to 1
    assert packed.row(0)[0].tolist() == [3, 2] and packed.row(0)[1].tolist() == [9, 1]
    # row 1: 6 fits; 5 does not fit the 4 left and is the shortest: cropped to 4
    assert packed.row(1)[0].tolist() == [0, 1] and packed.row(1)[1].tolist() == [6, 4]
    assert packed.num_rows == 2 and packed.cropped_tokens == 2 + 1


def test_bestfit_crops_no_more_than_nanochat():
    lengths = (np.random.default_rng(0).lognormal(5.5, 1.0, 20000) + 2).astype(np.int64)
    plan = BestFitPlan(lengths, 2048, seed=1, epoch=0)
    order = np.concatenate([plan.block_documents_ids(b) for b in range(plan.num_blocks)])
    reference = nanochat_bestfit_crop(lengths[order], 2049)
    assert plan.report().cropped_tokens <= reference["cropped"]


def test_bestfit_plan_rows_cover_blocks_once():
    lengths = np.random.default_rng(3).integers(2, 400, 3000)
    plan = BestFitPlan(lengths, 255, seed=5, epoch=2, block_documents=500)
    rows = plan.rows(np.arange(plan.size))
    assert sorted(r[0] for r in rows) == list(range(plan.size))
    used_docs = np.concatenate([r[1] for r in rows])
    assert len(used_docs) == len(set(used_docs.tolist()))
