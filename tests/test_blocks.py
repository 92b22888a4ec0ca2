"""Blocks: the windowed shuffle's unit of fetch and order (raypipe.sampling.blocks), the
window sized from the node cache's budget, a shard's tokens read a block at a time
(raypipe.io.ranged) and ranged reads of the cache (raypipe.io.cache.fetch_ranges)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.dataset import adjacent_runs
from raypipe.errors import ConfigError
from raypipe.io.cache import ShardCache
from raypipe.io.mapping import map_file
from raypipe.io.ranged import BlockTokens
from raypipe.io.records import FileEntry
from raypipe.io.store import Store
from raypipe.sampling.blocks import (
    BLOCK_ALIGN,
    MIXED_BLOCK_FLOOR,
    WHOLE_SHARDS,
    WindowBudget,
    block_sizes,
    cut_blocks,
    whole_shards,
)
from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.permute import WindowedPermutation

shard_lengths = st.lists(st.lists(st.integers(0, 300), min_size=0, max_size=25),
                         min_size=1, max_size=8)
# shards' document lengths, block_bytes, bytes a token
block_cuts = (shard_lengths, st.integers(1, 2000), st.sampled_from([1, 2, 4]))


def lengths_of(shards: list[list[int]]) -> tuple[DocumentLengths, np.ndarray]:
    counts = np.array([len(shard) for shard in shards], dtype=np.int64)
    flat = np.array([n for shard in shards for n in shard], dtype=np.int64)
    return DocumentLengths(counts, lambda s: flat[sum(counts[:s]):sum(counts[:s + 1])]), counts


@settings(max_examples=150, deadline=None)
@given(*block_cuts)
def test_blocks_cut_whole_documents_of_one_shard_each_about_block_bytes(
        shards, block_bytes, itemsize):
    lengths, counts = lengths_of(shards)
    blocks = cut_blocks(lengths, counts, itemsize, block_bytes)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    # a partition of every document, in storage order, no block empty
    assert blocks.starts[0] == 0 and blocks.starts[-1] == counts.sum()
    assert (np.diff(blocks.starts) > 0).all()
    for block in range(len(blocks)):
        shard = int(blocks.shards[block])
        first, stop = int(blocks.starts[block]), int(blocks.starts[block + 1])
        assert offsets[shard] <= first < stop <= offsets[shard + 1]  # never spans shards
        sizes = np.array(shards[shard], dtype=np.int64) * itemsize
        before = np.cumsum(sizes) - sizes  # byte offset of each document in its shard
        local = slice(first - offsets[shard], stop - offsets[shard])
        # the documents of a block start in one block_bytes stretch of the shard
        assert len(set((before[local] // block_bytes).tolist())) == 1
    # and a shard's consecutive blocks start in different stretches
    for block in range(1, len(blocks)):
        if blocks.shards[block] == blocks.shards[block - 1]:
            shard = int(blocks.shards[block])
            sizes = np.array(shards[shard], dtype=np.int64) * itemsize
            before = np.cumsum(sizes) - sizes
            ahead = before[int(blocks.starts[block] - offsets[shard])] // block_bytes
            behind = before[int(blocks.starts[block] - 1 - offsets[shard])] // block_bytes
            assert ahead > behind


@settings(max_examples=100, deadline=None)
@given(*block_cuts)
def test_a_blocks_size_is_its_documents_bytes_past_block_bytes_by_its_last_alone(
        shards, block_bytes, itemsize):
    lengths, counts = lengths_of(shards)
    blocks = cut_blocks(lengths, counts, itemsize, block_bytes)
    sizes = block_sizes(lengths, blocks, itemsize)
    flat = np.array([n for shard in shards for n in shard], dtype=np.int64) * itemsize
    for block in range(len(blocks)):
        first, stop = int(blocks.starts[block]), int(blocks.starts[block + 1])
        assert sizes[block] == flat[first:stop].sum()
        assert sizes[block] - flat[stop - 1] < block_bytes  # all but its last start inside


def test_block_bytes_of_whole_shards_is_the_layout_of_one_block_a_shard_empty_ones_too():
    lengths, counts = lengths_of([[5, 6], [], [7]])
    blocks = cut_blocks(lengths, counts, 2, WHOLE_SHARDS)
    assert blocks.starts.tolist() == [0, 2, 2, 3] and blocks.shards.tolist() == [0, 1, 2]
    assert blocks.starts.tolist() == whole_shards(counts).starts.tolist()


def test_a_windowed_order_of_whole_shard_blocks_is_the_windowed_order_of_shards():
    """States saved before blocks windowed whole shards: the same order under WHOLE_SHARDS."""
    counts = np.array([30, 0, 12, 41, 7, 19])
    blocks = whole_shards(counts)
    assert np.array_equal(WindowedPermutation(blocks.documents, 2, 9, 1)(np.arange(109)),
                          WindowedPermutation(counts, 2, 9, 1)(np.arange(109)))


def test_a_window_holds_the_budget_share_of_the_nodes_ranks():
    budget = WindowBudget(64 << 20, node_ranks=4, index_bytes=2 << 20)
    window = budget.window_bytes  # (64 MiB - 2 MiB) / 2 / (4 ranks x 2 windows)
    assert window == (31 << 20) // 8
    block = budget.block_bytes(0)
    assert block == window // 16
    assert budget.window_blocks(block) * block <= window
    assert budget.node_ranks * 2 * budget.window_blocks(block) * block + (2 << 20) <= 64 << 20


def test_windows_of_blocks_that_fetch_more_than_they_are_cut_by_hold_what_they_fetch():
    """Chat data's blocks are cut by the tokens' bytes and fetch the mask's too (1.5x for
    uint16): the windows of the node's ranks hold what they fetch within the budget's
    share, and the least budget named for a block is the least that holds it."""
    from dataclasses import replace

    plain = WindowBudget(64 << 20, node_ranks=4, index_bytes=2 << 20)
    chat = replace(plain, fetched_per_cut_byte=1.5)
    assert chat.window_bytes == int(plain.window_bytes // 1.5)
    block = chat.block_bytes(0)
    fetched = chat.node_ranks * 2 * chat.window_blocks(block) * block * 1.5
    windows_share = ((64 << 20) - (2 << 20)) / 2  # half of what the index files leave
    assert 15 / 16 * windows_share <= fetched <= windows_share
    least = chat.least_budget(256 << 10)
    assert least > plain.least_budget(256 << 10)
    replace(chat, budget_bytes=least).block_bytes(256 << 10)  # enough
    with pytest.raises(ConfigError):
        replace(chat, budget_bytes=least - 1).block_bytes(256 << 10)


def test_a_budget_below_one_block_a_rank_is_refused_in_one_line_naming_the_least_budget():
    small = WindowBudget(1 << 20, node_ranks=8, index_bytes=1000)
    with pytest.raises(ConfigError) as refused:
        small.block_bytes(256 << 10)
    message = str(refused.value)
    least = small.least_budget(256 << 10)
    assert f"cache_bytes >= {least:,}" in message and "\n" not in message
    WindowBudget(least, node_ranks=8, index_bytes=1000).block_bytes(256 << 10)  # enough
    with pytest.raises(ConfigError):
        WindowBudget(least - 1, node_ranks=8, index_bytes=1000).block_bytes(256 << 10)


def test_automatic_blocks_stay_within_their_bounds():
    assert WindowBudget(64 << 40).block_bytes(0) == 4 << 20  # a huge cache: the largest
    assert WindowBudget(1 << 20).block_bytes(0) == 16 << 10  # a small one: the smallest


def test_a_window_aims_at_twice_the_shards_in_blocks_where_that_reaches_near_uniform():
    window = WindowBudget(64 << 20, node_ranks=4).window_bytes  # 4 MiB
    # 10,000 shards: a window of 4 MiB holds no block of 32 KiB from each (near uniform
    # is out of reach), so the fewest blocks; 0 shards: unknown, likewise
    for shards, blocks in [(0, 16), (5, 16), (20, 40), (64, 128), (10_000, 16)]:
        budget = WindowBudget(64 << 20, node_ranks=4, shards=shards)
        assert budget.block_bytes(0) == window // blocks // BLOCK_ALIGN * BLOCK_ALIGN
        assert budget.mixes_near_uniform == (0 < shards < 10_000)
    # blocks made smaller for mixing stop at MIXED_BLOCK_FLOOR (a 1.5 MiB window, 40
    # shards: 80 blocks would be 19 KiB), never above 1/16 of the window
    assert WindowBudget(24 << 20, node_ranks=4, shards=40).block_bytes(0) == MIXED_BLOCK_FLOOR
    assert WindowBudget(4 << 20, node_ranks=4, shards=8).block_bytes(0) == 16 << 10


@pytest.mark.parametrize("shards", [20, 64])
def test_an_automatic_window_draws_a_ranks_next_document_from_its_shard_near_uniform(shards):
    """Shards of 2.5 MB, a budget of 10% of the data for one rank: a rank's next document
    comes from its document's shard at most 2x as often as under a uniform order (a window
    of 16 blocks, the size before, made it 2.2x at 20 shards and 4.7x at 64)."""
    documents, tokens = 1250, 1000  # a shard's documents, and each one's tokens (uint16)
    counts = np.full(shards, documents, dtype=np.int64)
    lengths = DocumentLengths(counts, lambda s: np.full(documents, tokens, dtype=np.int64))
    budget = WindowBudget(shards * documents * tokens * 2 // 10, shards=shards)
    block_bytes = budget.block_bytes(0)
    blocks = cut_blocks(lengths, counts, 2, block_bytes)
    order = WindowedPermutation(blocks.documents, budget.window_blocks(block_bytes), 7)(
        np.arange(shards * documents, dtype=np.int64))
    shard_of = order // documents
    same = float(np.mean(shard_of[1:] == shard_of[:-1]))
    assert same <= 2 / shards


@pytest.mark.parametrize("window", [BLOCK_ALIGN, 3 * BLOCK_ALIGN + 100, (16 << 10) - 1])
def test_a_window_under_the_smallest_automatic_block_takes_the_largest_it_holds(window):
    """A small cache over small shards (issue 75's 2 shards a rank at 10%) runs with one
    block a window of whole checksum units, instead of refusing a 16 KiB block."""
    budget = WindowBudget(window * 2 * 2 * 2, node_ranks=2)  # 2 windows a rank, 50% share
    assert budget.window_bytes == window
    block = budget.block_bytes(0)
    assert block == window // BLOCK_ALIGN * BLOCK_ALIGN and block % BLOCK_ALIGN == 0
    assert budget.window_blocks(block) == 1


def test_a_window_under_one_checksum_unit_is_refused_naming_the_least_budget():
    budget = WindowBudget((BLOCK_ALIGN - 1) * 8, node_ranks=2, index_bytes=0)
    with pytest.raises(ConfigError) as refused:
        budget.block_bytes(0)
    assert f"cache_bytes >= {budget.least_budget(BLOCK_ALIGN):,}" in str(refused.value)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12), data=st.data())
def test_block_tokens_slice_and_index_like_the_shard_array(sizes, data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("blocks")
    cuts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    tokens = np.arange(int(cuts[-1]), dtype=np.uint16) * 7 + 3
    paths = []
    for block in range(len(sizes)):
        path = folder / f"b{block}"
        path.write_bytes(tokens[cuts[block]:cuts[block + 1]].tobytes())
        paths.append(path)
    opened: list[int] = []

    def load(block: int, count: int) -> np.ndarray:
        opened.append(block)
        return map_file(paths[block], np.uint16, 0, count)

    view = BlockTokens(cuts, np.dtype(np.uint16), load)
    assert view.size == tokens.size and len(view) == tokens.size
    start = data.draw(st.integers(0, tokens.size))
    stop = data.draw(st.integers(start, tokens.size))
    assert np.array_equal(view[start:stop], tokens[start:stop])
    picks = np.array(data.draw(st.lists(st.integers(0, tokens.size - 1), max_size=10)),
                     dtype=np.int64)
    assert np.array_equal(view[picks], tokens[picks])
    assert len(opened) == len(set(opened))  # each block mapped once
    view.forget(lambda index: False)  # every block unmapped, then mapped again
    assert np.array_equal(view[0:tokens.size], tokens)


def test_ranges_of_a_file_are_cached_each_in_a_file_adjacent_ones_read_together(tmp_path):
    data = bytes(range(256)) * 40
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "t.bin").write_bytes(data)
    store = Store(str(tmp_path / "root"))
    entry = FileEntry("t.bin", len(data), "unused")
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    ranges = [(0, 100), (100, 250), (4000, 5000)]
    paths = cache.fetch_ranges(store, "key", entry, ranges)
    assert [path.read_bytes() for path in paths] == [data[a:b] for a, b in ranges]
    assert cache.stats.ranged_reads == 2  # [0, 250) in one read, [4000, 5000) in another
    assert cache.stats.downloaded_bytes == 250 + 1000
    again = cache.fetch_ranges(store, "key", entry, ranges[:2])
    assert again == paths[:2] and cache.stats.ranged_reads == 2 and cache.stats.hits == 2
    with pytest.raises(Exception, match="outside the file"):
        cache.fetch_ranges(store, "key", entry, [(10_000, 10_300)])


def test_a_state_that_windowed_whole_shards_resumes_at_the_same_batches(token_dataset):
    """A state saved before blocks (its window counted in shards, `window_shards`, and no
    block_bytes) resumes under the whole-shard windows it was made with, not blocks."""
    from raypipe.loader import TokenLoader

    def loader():
        return TokenLoader(token_dataset, 32, 4, seed=3, shuffle="windowed")

    before = TokenLoader(token_dataset, 32, 4, seed=3, shuffle="windowed",
                         block_bytes=WHOLE_SHARDS, window_blocks=2)
    batches = iter(before)
    next(batches)
    state = before.state_dict()
    expected = [batch.inputs.numpy().tobytes() for batch in batches]
    knobs = dict(state["knobs"])
    assert "block_bytes" not in knobs  # at its value from before blocks: left out
    knobs["window_shards"] = knobs.pop("window_blocks")
    resumed = loader()
    resumed.load_state_dict({**state, "knobs": knobs})
    assert resumed.spec.block_bytes == WHOLE_SHARDS and resumed.spec.window_blocks == 2
    assert [batch.inputs.numpy().tobytes() for batch in resumed] == expected
    fresh = loader()
    assert fresh.spec.block_bytes < WHOLE_SHARDS  # a new run windows blocks
    assert fresh.state_dict()["knobs"]["block_bytes"] == fresh.spec.block_bytes


def test_a_new_windowed_run_mixes_blocks_of_many_shards_in_each_window(token_dataset):
    """Blocks smaller than a shard: a window of the same bytes draws from more shards."""
    from raypipe.loader import TokenLoader

    loader = TokenLoader(token_dataset, 32, 4, seed=3, shuffle="windowed", block_bytes=4096,
                         window_blocks=4)
    blocks = loader.run.planned.plans.blocks()
    assert len(blocks) > 2 * loader.dataset.num_shards
    order = loader.run.planned.plans.groups()
    permutation = WindowedPermutation(order.block_documents, order.window_blocks, 3)
    shards = {int(blocks.shards[b]) for b in permutation.window_block_ids(0)}
    assert len(shards) > 1


def test_shards_that_cannot_be_read_a_block_at_a_time_window_whole_shards(tmp_path,
                                                                          corpus_dir,
                                                                          tokenizer_path):
    """NanoGPT written without BOS (no `.bos.idx`) finds no block's bytes from an index, nor
    does MDS compressed with zstd or written before its shards carried `.offsets`, and a
    stream or MDS output written before its shards carried a `.sums` could not check a
    block: `block_bytes=0` resolves to whole shards there (fetching a whole shard for each
    small block would refetch it a window after another), and to blocks for Megatron,
    NanoGPT with its `.bos.idx`, stream with its `.sums` and MDS with both sidecars,
    locally as on a bucket."""
    from raypipe.loader import TokenLoader
    from tests.helpers import tokenize, without_sidecar

    def block_bytes(output, fmt):
        return TokenLoader(str(output), 32, 4, shuffle="windowed", format=fmt).spec.block_bytes

    output = tokenize(corpus_dir, tmp_path / "out", tokenizer_path,
                      formats=["megatron", "nanogpt", "stream", "mds"])
    assert block_bytes(output, "megatron") < WHOLE_SHARDS
    assert block_bytes(output, "nanogpt") < WHOLE_SHARDS
    assert block_bytes(output, "stream") < WHOLE_SHARDS
    assert block_bytes(output, "mds") < WHOLE_SHARDS
    assert block_bytes(without_sidecar(output, "stream", ".sums"), "stream") == WHOLE_SHARDS
    assert block_bytes(without_sidecar(output, "mds", ".sums"), "mds") == WHOLE_SHARDS
    assert block_bytes(without_sidecar(tokenize(corpus_dir, tmp_path / "mds", tokenizer_path,
                                                formats=["mds"]), "mds", ".offsets"),
                       "mds") == WHOLE_SHARDS
    zstd = tokenize(corpus_dir, tmp_path / "zstd", tokenizer_path, formats=["mds"],
                    format_options={"mds": {"compression": "zstd"}})
    assert not list((zstd / "mds").glob("*.sums"))
    assert block_bytes(zstd, "mds") == WHOLE_SHARDS
    without_bos = tokenize(corpus_dir, tmp_path / "eos", tokenizer_path, formats=["nanogpt"],
                           bos=False, eos=True)
    assert not list((without_bos / "nanogpt").glob("*.bos.idx"))
    assert block_bytes(without_bos, "nanogpt") == WHOLE_SHARDS


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 3)), min_size=1, max_size=30,
                unique_by=lambda start_length: start_length[0]))
def test_adjacent_block_ranges_are_fetched_as_one_run_and_no_two_runs_touch(starts):
    """A prefetch's ranges of one shard: runs partition them, each run's bytes follow each
    other (one GET), and two runs never touch (else they would be one GET)."""
    spans, end = [], -1
    for at, length in sorted(starts):
        start = max(at * 4, end)  # ranges of one file never overlap
        spans.append((len(spans), (start, start + length)))
        end = start + length
    shuffled = spans[::-1]
    runs = adjacent_runs(shuffled)
    assert sorted(unit_span for run in runs for unit_span in run) == sorted(spans)
    for run in runs:
        assert all(a[1][1] == b[1][0] for a, b in zip(run, run[1:], strict=False))
    ends = sorted((run[0][1][0], run[-1][1][1]) for run in runs)
    assert all(stop < start for (_, stop), (start, _) in zip(ends, ends[1:], strict=False))


def test_a_resumed_layout_is_kept_where_the_budget_no_longer_holds_its_windows():
    """A run that chose 16 KiB blocks at 2 ranks a node resumes at 3 on the same budget
    (issue 75's 2 -> 3 resume): its recorded layout is kept, not refused; a fresh run
    asking that block size of the same budget, a lane a rank, is refused (the node's 3
    ranks sharing one lane's windows, lane_ranks=3, hold it)."""
    from raypipe.sampling.modes import PlanSpec
    from raypipe.sampling.resolve import RunFacts, resolve

    budget = WindowBudget(150_000, node_ranks=3, index_bytes=8_000)
    saved = {"shuffle": "windowed", "block_bytes": 16 << 10, "window_blocks": 1, "lanes": 2}
    resumed = resolve(PlanSpec.of(seq_len=64), RunFacts(False, 3, budget, saved))
    assert (resumed.block_bytes, resumed.window_blocks, resumed.lanes) == (16 << 10, 1, 2)
    assert resumed.lane_ranks == 1  # a state from before lane_ranks: a lane a rank
    with pytest.raises(ConfigError):
        resolve(PlanSpec.of(seq_len=64, shuffle="windowed", block_bytes=16 << 10),
                RunFacts(False, 3, budget))
    shared = resolve(PlanSpec.of(seq_len=64, shuffle="windowed", block_bytes=16 << 10,
                                 lane_ranks=3), RunFacts(False, 3, budget))
    assert (shared.lanes, shared.lane_ranks, shared.block_bytes) == (1, 3, 16 << 10)


def test_auto_on_a_bucket_reads_shard_local_groups_that_fit_the_cache_where_no_block_serves():
    """Mode windows cuts rows from the token stream, not documents, so no windowed shuffle
    serves it; on object storage whose node cache holds less than the dataset, "auto" is
    then shard-local groups of what the cache holds two groups of (the global shuffle
    would fetch shards again and again), and a resumed state keeps its groups on another
    budget. Where the cache holds the dataset, on local disk, for a mixture's source and
    for the document modes, auto is what it was."""
    from raypipe.sampling.modes import PlanSpec
    from raypipe.sampling.resolve import RunFacts, resolve

    def resolved(budget, local=False, saved=None, **knobs):
        spec = resolve(PlanSpec.of(knobs.pop("mode", "windows"), seq_len=64, **knobs),
                       RunFacts(local, 2, budget, saved))
        return spec.shuffle, spec.group_shards

    small = WindowBudget(10_000_000, dataset_bytes=50_000_000, largest_shard_bytes=1_000_000)
    assert resolved(small) == ("shard_local", 5)
    assert resolved(small, shuffle="shard_local") == ("shard_local", 5)
    assert resolved(small, shuffle="shard_local", group_shards=3) == ("shard_local", 3)
    assert resolved(small, local=True) == ("global", 4)
    assert resolved(WindowBudget(60_000_000, dataset_bytes=50_000_000,
                                 largest_shard_bytes=1_000_000)) == ("global", 4)
    assert resolved(WindowBudget(10_000_000, sources=2, dataset_bytes=50_000_000,
                                 largest_shard_bytes=1_000_000)) == ("global", 4)
    assert resolved(small, mode="bestfit")[0] == "windowed"
    larger = WindowBudget(40_000_000, dataset_bytes=50_000_000, largest_shard_bytes=1_000_000)
    assert resolved(larger) == ("shard_local", 20)
    saved = {"shuffle": "shard_local", "group_shards": 5}
    assert resolved(larger, saved=saved) == ("shard_local", 5)
    assert resolved(larger, saved={"shuffle": "global"}) == ("global", 4)
