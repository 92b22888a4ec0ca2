"""The mixing advice: where a smaller block_bytes would mix shards better at the rate a
loop reads, and only within the request and memory bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from raypipe.loader.mixing import (
    BETTER,
    BLOCK_RECORD_BYTES,
    BLOCK_TABLE_BYTES,
    MAX_GETS_A_SECOND,
    Mixing,
    times_uniform,
)
from raypipe.sampling.blocks import BLOCK_ALIGN, WindowLayout

TB = 10**12


def layout(shards: int, cut_bytes: int, block_bytes: int, window_blocks: int
           ) -> WindowLayout:
    return WindowLayout("s3://bucket/tokens", shards, cut_bytes, block_bytes, window_blocks)


def test_at_scale_a_slow_loop_is_told_the_block_size_its_node_can_hold_the_blocks_of():
    """4 TB in 10^4 shards, windows of 23 blocks of 4 MiB, a rank reading 8 KB a second
    (4 M tokens a step at 1 step/s over 1,000 ranks): near-uniform windows would need
    blocks of ~5 KB, whose 800 M blocks are past the node's block arrays; the least block
    those allow (~240 KB) mixes ~17x better for a GET every ~30 s."""
    mixing = Mixing(layout(10_000, 4 * TB, 4 << 20, 23), read_bytes_per_s=8_000)
    block = mixing.better_block_bytes
    by_table = 4 * TB * BLOCK_RECORD_BYTES / BLOCK_TABLE_BYTES
    assert block % BLOCK_ALIGN == 0 and by_table <= block < by_table + BLOCK_ALIGN
    window = mixing.window_with(block)
    assert 390 <= window <= 410 and mixing.times_uniform > 430
    assert times_uniform(10_000, window) < 27
    line = mixing.advice()
    assert f"block_bytes={block}" in line and "s3://bucket/tokens" in line
    assert "mixes 23 blocks of 4,194,304 bytes a window from 10,000 shards" in line
    assert "~436x" in line and "8.0 KB/s a rank" in line
    assert f"{8_000 / block:.2f} GETs a second a rank" in line
    assert mixing.metrics() == {"shard_mix_x_uniform": round(mixing.times_uniform, 1),
                                "advised_block_bytes": block}


def test_a_loop_that_reads_fast_is_not_told_to_make_more_gets_than_it_can_afford():
    """The bench's 200 small shards a rank at a 10% cache: windows of 16 blocks of 45 KB,
    a rank reading 3.3 MB a second; blocks small enough to mix better would cost more
    than MAX_GETS_A_SECOND GETs a second (the least block the rate allows is larger)."""
    mixing = Mixing(layout(405, 61_000_000, 45_056, 16), read_bytes_per_s=3.3e6)
    assert mixing.least_block_bytes >= 3.3e6 / MAX_GETS_A_SECOND > 45_056
    assert mixing.better_block_bytes == 0 and mixing.advice() == ""
    assert mixing.metrics()["advised_block_bytes"] == 0


def test_windows_that_already_mix_near_uniform_get_no_advice():
    near = Mixing(layout(41, 200_000_000, 74_000, 84), read_bytes_per_s=10)
    assert near.times_uniform < 2 and near.advice() == ""


def test_advice_that_would_mix_less_than_twice_as_well_is_not_given():
    """Windows of 30 blocks of 64 KiB from 60 shards (3x uniform), where the node's block
    arrays allow blocks of 32 KiB at least: 60 blocks a window, 2x uniform, not BETTER
    times better, so nothing is said."""
    block = 64 << 10
    dataset = (block // 2) * BLOCK_TABLE_BYTES // BLOCK_RECORD_BYTES
    mixing = Mixing(layout(60, dataset, block, 30), read_bytes_per_s=1.0)
    assert mixing.least_block_bytes == block // 2 and mixing.times_uniform == 3.0
    assert times_uniform(60, mixing.window_with(block // 2)) == 2.0
    assert mixing.better_block_bytes == 0 and mixing.advice() == ""


@settings(max_examples=300, deadline=None)
@given(shards=st.integers(1, 10**5), window=st.integers(1, 4096),
       units=st.integers(1, 2048), rate=st.floats(0, 1e9),
       dataset_units=st.integers(1, 10**9))
def test_advised_blocks_are_whole_units_within_the_bounds_and_mix_better(
        shards, window, units, rate, dataset_units):
    block = units * BLOCK_ALIGN
    mixing = Mixing(layout(shards, dataset_units * BLOCK_ALIGN, block, window), rate)
    advised = mixing.better_block_bytes
    if not advised:
        return
    assert advised % BLOCK_ALIGN == 0 and BLOCK_ALIGN <= advised < block
    assert rate / advised <= MAX_GETS_A_SECOND
    assert dataset_units * BLOCK_ALIGN * BLOCK_RECORD_BYTES / advised <= BLOCK_TABLE_BYTES
    better = times_uniform(shards, mixing.window_with(advised))
    assert mixing.times_uniform >= BETTER * better
