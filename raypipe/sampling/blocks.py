"""Blocks: the windowed shuffle's unit of fetch and order, a run of whole documents of one
shard about `block_bytes` long, and the window sized from the node cache's budget.

Invariant: blocks partition the documents a plan numbers, in storage order; a block never
spans two shards and never cuts a document (a document starts block k of its shard when
its first token's byte offset in the shard lies in [k x block_bytes, (k + 1) x
block_bytes)); so a shard smaller than `block_bytes` is one block, and a document longer
than a block is a block of its own. The cut is a pure function of (lengths, documents per
shard, token size, block_bytes): every rank and a resumed run cut the same blocks.
`block_bytes` of WHOLE_SHARDS makes every shard one block (empty shards included): the
layout of the releases that windowed whole shards, kept for their states. Cost: one
vectorized pass over each shard's lengths (~10 ns a document), once per node (the plan
cache); O(blocks) memory after; `block_sizes` (a bucket run's check for documents longer
than a window) one more such pass, once per node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from raypipe.errors import ConfigError
from raypipe.io.checksums import UNIT_BYTES
from raypipe.sampling.lengths import DocumentLengths

WHOLE_SHARDS = 1 << 62  # block_bytes that cuts no shard: one block a shard
WINDOWS_HELD = 2  # windows a rank holds: the one it reads and the next, fetched ahead
WINDOW_SHARE = 0.5  # of the node cache's budget less the index files: the node's windows
HOLD_SHARE = 0.8  # ... and what the node's ranks hold and fetch ahead, all together
GROUPS_HELD = 2  # shard-local groups the node cache holds: the one read and the next
# block_bytes 0: where blocks of MIXED_BLOCK_FLOOR can make a window of as many blocks
# as the dataset has shards (a window's bytes / shards >= the floor), a window of about
# MIXED_SHARDS x the shards in blocks, within BLOCKS_PER_WINDOW: a rank's next document
# then comes from its document's shard with P ~ 1/blocks + 1/shards, within 2x of a
# uniform order's 1/shards; else, where no block size this side of the floor gets there,
# the fewest blocks (a block is a GET: a rank makes bytes it reads a second / block_bytes
# GETs a second, and smaller blocks that cannot reach near uniform buy little mixing)
MIXED_SHARDS = 2
BLOCKS_PER_WINDOW = (16, 128)
BLOCK_BYTES_RANGE = (16 << 10, 4 << 20)  # ... the blocks within these bounds (GET cost vs
# mixing), where a window holds the floor; a smaller window holds one block of what it can
# blocks made smaller than 1/16 of a window for mixing stop here: at 16 KiB a rank that
# reads 3.3 MB a second (bench/bucket_bench.py's) makes 200 GETs a second, more than a
# loopback moto serves 2 ranks on 2 cores (waits p99 93-185 ms; 25 KiB: 4 ms)
MIXED_BLOCK_FLOOR = 32 << 10
# block_bytes is a multiple of a shard's checksum unit, so a block is a run of whole units
# checked as it arrives (raypipe.io.checksums)
BLOCK_ALIGN = UNIT_BYTES


@dataclass(frozen=True)
class WindowLayout:
    """A windowed plan of blocks on object storage, as its loader reads it: the dataset
    (`root`, its `shards`, and `cut_bytes`: the bytes its blocks are cut from, tokens x
    bytes a token), its blocks' `block_bytes` and the blocks a window holds (built by
    raypipe.sampling.run.Run.window_layouts)."""

    root: str
    shards: int
    cut_bytes: int
    block_bytes: int
    window_blocks: int


def check_block_bytes(block_bytes: int) -> None:
    """Refuse a block size that is not a multiple of BLOCK_ALIGN, naming the nearest."""
    if block_bytes % BLOCK_ALIGN and block_bytes < WHOLE_SHARDS:
        below = max(block_bytes // BLOCK_ALIGN * BLOCK_ALIGN, BLOCK_ALIGN)
        raise ConfigError(f"block_bytes: {block_bytes:,} must be a multiple of "
                          f"{BLOCK_ALIGN:,} (a block is a run of whole checksum units of a "
                          f"shard's .sums): e.g. {below:,} or {below + BLOCK_ALIGN:,}")


@dataclass(frozen=True)
class Blocks:
    """Blocks of whole documents: `starts[b]` is block b's first document (in the plan's
    numbering) and `starts[-1]` the count; `shards[b]` the shard it lies in."""

    starts: np.ndarray
    shards: np.ndarray

    @property
    def documents(self) -> np.ndarray:
        """Documents each block holds."""
        return np.diff(self.starts)

    def __len__(self) -> int:
        return len(self.shards)

    def in_shards(self, shards: int) -> int:
        """How many blocks the first `shards` shards hold (they come first)."""
        return int(np.searchsorted(self.shards, shards, side="left"))

    def of_documents(self, documents: np.ndarray) -> np.ndarray:
        """The block of each document (plan numbering)."""
        return np.searchsorted(self.starts, np.asarray(documents, dtype=np.int64),
                               side="right") - 1


def whole_shards(shard_documents: np.ndarray) -> Blocks:
    """One block a shard (empty ones included)."""
    counts = np.asarray(shard_documents, dtype=np.int64)
    return Blocks(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                  np.arange(len(counts), dtype=np.int64))


def cut_blocks(lengths: DocumentLengths, shard_documents: np.ndarray, itemsize: int,
               block_bytes: int) -> Blocks:
    """The blocks of about `block_bytes` of whole documents of each shard (`lengths`:
    tokens of each document the plan numbers; `shard_documents`: how many of them each
    shard holds; `itemsize`: bytes a token)."""
    if block_bytes < 1:
        raise ConfigError(f"block_bytes: {block_bytes} must be >= 1")
    if block_bytes >= WHOLE_SHARDS:
        return whole_shards(shard_documents)
    offsets = np.concatenate([[0], np.cumsum(shard_documents)]).astype(np.int64)
    starts: list[np.ndarray] = []
    shards: list[np.ndarray] = []
    for shard in range(len(offsets) - 1):
        first, stop = int(offsets[shard]), int(offsets[shard + 1])
        if first == stop:
            continue
        sizes = lengths[np.arange(first, stop, dtype=np.int64)] * itemsize
        before = np.cumsum(sizes) - sizes  # bytes of the shard's documents before each
        block = before // block_bytes
        heads = np.concatenate([[0], np.flatnonzero(np.diff(block)) + 1]) + first
        starts.append(heads)
        shards.append(np.full(heads.size, shard, dtype=np.int64))
    if not starts:
        return Blocks(np.zeros(1, dtype=np.int64), np.empty(0, dtype=np.int64))
    return Blocks(np.concatenate([*starts, [int(offsets[-1])]]).astype(np.int64),
                  np.concatenate(shards))


def block_sizes(lengths: DocumentLengths, blocks: Blocks, itemsize: int) -> np.ndarray:
    """The bytes of each block's tokens (`lengths` in the plan's numbering, as cut): a block
    passes `block_bytes` by at most its last document, and a document longer than a block
    is a block of its own. One vectorized pass over each shard's lengths."""
    sizes = np.zeros(len(blocks), dtype=np.int64)
    edges = np.flatnonzero(np.diff(blocks.shards)) + 1
    for first, stop in zip(np.concatenate([[0], edges]).tolist(),
                           np.concatenate([edges, [len(blocks)]]).tolist(), strict=True):
        heads = blocks.starts[first:stop + 1]
        tokens = np.concatenate([[0], np.cumsum(lengths[np.arange(heads[0], heads[-1],
                                                                  dtype=np.int64)])])
        sizes[first:stop] = np.diff(tokens[heads - heads[0]]) * itemsize
    return sizes


@dataclass(frozen=True)
class WindowBudget:
    """What sizes a window from the node cache: its budget, the ranks that share it (each
    lane they read holds WINDOWS_HELD windows: a lane a rank, or one a `ranks_per_lane`
    of them), the bytes the index files keep there, and whether the shards can be read a
    block at a time."""

    budget_bytes: int
    node_ranks: int = 1
    index_bytes: int = 0
    # the data's shards can be read a block at a time (its format finds a block's bytes
    # from its index, a loss-mask sidecar has its sums); else block_bytes 0 is whole shards
    ranged: bool = True
    # datasets whose windows share the node cache (a mixture's sources on object storage):
    # each has an equal part of it
    sources: int = 1
    # the dataset's bytes, and its largest shard's (what a shard-local group is sized by)
    dataset_bytes: int = 0
    largest_shard_bytes: int = 0
    shards: int = 0  # the dataset's shards (0: unknown, the fewest blocks a window)
    # bytes a block fetches for each byte it is cut by (chat data: its loss mask's too)
    fetched_per_cut_byte: float = 1.0
    # consecutive ranks that read one lane in turn (lane_ranks): they share its windows
    ranks_per_lane: int = 1

    def for_lanes(self, ranks_per_lane: int) -> WindowBudget:
        """This budget for lanes each read by `ranks_per_lane` ranks (0: one)."""
        return replace(self, ranks_per_lane=max(ranks_per_lane, 1))

    @property
    def holds_dataset(self) -> bool:
        """The node cache holds the whole dataset (its part of it, for a mixture's source):
        a global shuffle then fetches each shard once."""
        return self.dataset_bytes * self.sources <= self.budget_bytes

    def shard_group(self) -> int:
        """The most shards a shard-local group holds with GROUPS_HELD groups of the largest
        shards in the cache (at least one)."""
        if not self.largest_shard_bytes:
            return 1
        return max(1, self.budget_bytes // (self.sources * GROUPS_HELD
                                            * self.largest_shard_bytes))

    @property
    def node_lanes(self) -> int:
        """Lanes whose windows the node holds, for each source: its ranks over the ranks
        that share a lane (a node's ranks are consecutive, as torchrun and Ray Train
        number them)."""
        return -(-self.node_ranks // self.ranks_per_lane) * self.sources

    @property
    def window_bytes(self) -> int:
        """The bytes one window may hold, counted as blocks are cut (what it fetches,
        over `fetched_per_cut_byte`)."""
        usable = (self.budget_bytes - self.index_bytes) * WINDOW_SHARE
        return max(int(usable // (self.node_lanes * WINDOWS_HELD
                                  * self.fetched_per_cut_byte)), 0)

    @property
    def hold_bytes(self) -> int:
        """What one rank holds and fetches ahead at most: its lane's share of HOLD_SHARE
        of what the index files leave (the windows are half; reading ahead may reach into
        later windows while the link's latency needs it). The ranks that share a lane
        hold the same blocks, once in the node cache."""
        return max(int((self.budget_bytes - self.index_bytes) * HOLD_SHARE
                       // self.node_lanes), 0)

    def least_budget(self, block_bytes: int) -> int:
        """The least budget whose windows hold one block of `block_bytes`."""
        return self.index_bytes + int(np.ceil(block_bytes * self.fetched_per_cut_byte
                                              * self.node_lanes * WINDOWS_HELD
                                              / WINDOW_SHARE))

    def block_bytes(self, asked: int) -> int:
        """`asked`, or (0) the automatic size (`_automatic_block_bytes`); a budget whose
        window holds no block is refused, naming the least budget."""
        chosen = asked or self._automatic_block_bytes()
        if self.window_bytes < chosen:
            raise ConfigError(
                f"cache_bytes {self.budget_bytes:,} holds no block of {chosen:,} bytes for "
                f"each of the node's {self.node_ranks} rank(s){self._lanes_said()}"
                f"{self._of_sources()} (two windows a lane in "
                f"{WINDOW_SHARE:.0%} of what {self.index_bytes:,} bytes of index files "
                f"leave): give cache_bytes >= {self.least_budget(chosen):,}, or a smaller "
                "block_bytes")
        return chosen

    @property
    def blocks_per_window(self) -> int:
        """The blocks an automatic window aims at: MIXED_SHARDS x the dataset's shards,
        within BLOCKS_PER_WINDOW."""
        fewest, most = BLOCKS_PER_WINDOW
        return min(max(MIXED_SHARDS * self.shards, fewest), most)

    @property
    def mixes_near_uniform(self) -> bool:
        """Blocks of MIXED_BLOCK_FLOOR or more can make a window of as many blocks as the
        dataset has shards: a rank's next document can come from its shard within 2x of
        a uniform order's rate."""
        return bool(self.shards) and self.window_bytes // self.shards >= MIXED_BLOCK_FLOOR

    def _automatic_block_bytes(self) -> int:
        """1/16 of a window within BLOCK_BYTES_RANGE, made smaller (to 1/`blocks_per_window`
        of it, MIXED_BLOCK_FLOOR at least) where that `mixes_near_uniform`; a window under
        the range's floor takes the largest whole number of BLOCK_ALIGN it holds (a block a
        window, more GETs: a small cache over small shards), BLOCK_ALIGN at least."""
        low, high = BLOCK_BYTES_RANGE
        fitted = min(max(self.window_bytes // BLOCKS_PER_WINDOW[0], low), high)
        if self.mixes_near_uniform:
            fitted = min(fitted, max(self.window_bytes // self.blocks_per_window,
                                     MIXED_BLOCK_FLOOR))
        if self.window_bytes < fitted:
            fitted = max(self.window_bytes, BLOCK_ALIGN)
        return int(fitted // BLOCK_ALIGN * BLOCK_ALIGN)

    def _lanes_said(self) -> str:
        if self.ranks_per_lane == 1:
            return ""
        return f" in {self.node_lanes // self.sources} lane(s) of {self.ranks_per_lane} ranks"

    def _of_sources(self) -> str:
        return "" if self.sources == 1 else f" and {self.sources} sources on object storage"

    def window_blocks(self, block_bytes: int) -> int:
        """The most blocks of `block_bytes` a window holds (at least one; a lane's blocks
        cap it where the plan is made: raypipe.sampling.plans.window_blocks_for)."""
        return int(max(1, self.window_bytes // block_bytes))
