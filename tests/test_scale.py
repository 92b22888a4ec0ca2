"""Per-rank costs that must not grow with the corpus: document lengths read through the
index maps (no private per-document array), block sums computed once per node and shared,
the first batch after describing one step (fast unit tests; bench/scale_bench.py measures
them at 10^8 documents)."""

from __future__ import annotations

import numpy as np
import pytest

from raypipe.io.cache import node_cached_array
from raypipe.loader import TokenLoader
from raypipe.sampling.modes.bestfit import BestFitPlan


def test_node_cached_array_is_computed_once_then_loaded(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return np.arange(5, dtype=np.int64)

    first = node_cached_array("k", compute, tmp_path)
    second = node_cached_array("k", lambda: pytest.fail("computed twice"), tmp_path)
    assert calls == [1] and np.array_equal(first, second)


def test_node_cached_array_recomputes_a_damaged_file_and_works_without_a_writable_dir(
        tmp_path):
    node_cached_array("k", lambda: np.arange(3), tmp_path)
    (tmp_path / "plans" / "k.npy").write_bytes(b"not an array")
    assert np.array_equal(node_cached_array("k", lambda: np.arange(4), tmp_path), np.arange(4))
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory would be")
    assert np.array_equal(node_cached_array("k", lambda: np.arange(2), blocked), np.arange(2))


def test_a_rank_maps_one_node_file_of_lengths_written_once(token_dataset, tmp_path,
                                                          monkeypatch):
    from raypipe.dataset import TokenDataset

    loader = TokenLoader(token_dataset, 16, 2, mode="bestfit", cache_dir=tmp_path)
    lengths = loader.run.planned.document_lengths()
    ((_, mapped),) = list(lengths.chunks())
    assert mapped.dtype == np.int32 and not mapped.flags.owndata
    assert not mapped.flags.writeable  # a read-only map of the node's file, not a copy
    expected = TokenDataset(token_dataset).document_lengths()
    assert np.array_equal(mapped, expected) and lengths.total == int(expected.sum())
    ids = np.random.default_rng(0).permutation(len(lengths))[:500]
    assert np.array_equal(lengths[ids], expected[ids])
    monkeypatch.setattr(TokenDataset, "shard_document_lengths",
                        lambda *_: pytest.fail("lengths file written twice"))
    again = TokenLoader(token_dataset, 16, 2, mode="bestfit", rank=1, world_size=2,
                        cache_dir=tmp_path)
    assert np.array_equal(again.run.planned.document_lengths()[ids], expected[ids])


def test_shard_lengths_without_the_node_cache_are_views_of_the_index_files(token_dataset):
    from raypipe.dataset import TokenDataset
    from raypipe.sampling.lengths import dataset_lengths

    lengths = dataset_lengths(TokenDataset(token_dataset), node_cache=False)
    assert lengths.num_shards > 1
    for _, shard_lengths in lengths.chunks():
        assert shard_lengths.dtype == np.int32 and not shard_lengths.flags.owndata
        assert not shard_lengths.flags.writeable  # the read-only map of the .idx


def test_ranks_on_a_node_share_one_computation_of_the_block_sums(token_dataset, monkeypatch):
    first = TokenLoader(token_dataset, 16, 2, mode="bestfit", rank=0, world_size=2, seed=4)
    offsets = first.plan().row_offsets

    def no_second_pass(self):
        raise AssertionError("block sums computed again on the same node")

    monkeypatch.setattr(BestFitPlan, "block_token_sums", no_second_pass)
    second = TokenLoader(token_dataset, 16, 2, mode="bestfit", rank=1, world_size=2, seed=4)
    assert np.array_equal(second.plan().row_offsets, offsets)
    monkeypatch.undo()
    fresh = BestFitPlan(first.run.planned.document_lengths().to_array(), 16, 4, 0)
    assert np.array_equal(fresh.row_offsets, offsets)  # the cached sums are the true ones


def test_the_next_epochs_plan_is_prepared_in_the_background(token_dataset, monkeypatch):
    loader = TokenLoader(token_dataset, 16, 2, mode="bestfit", seed=8)
    loader.run.prepare_epoch(5).join()
    monkeypatch.setattr(BestFitPlan, "block_token_sums",
                        lambda self: pytest.fail("epoch 5 computed at the boundary"))
    assert loader.plan(5).size > 0
