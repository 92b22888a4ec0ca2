"""How well a windowed shuffle of a bucket mixes shards at the rate a loop reads, and the
block size that would mix better at a request rate that rate can afford: the one layout
figure the loader cannot choose alone, because the plan is made before the loop's rate
is known (it must be the same on every rank and at every resume).

Invariant: advice is only given where it holds at the rate measured: the block size named
mixes at least twice as well as the plan's, keeps a rank under MAX_GETS_A_SECOND GETs a
second at the measured read rate and the node's plan under BLOCK_TABLE_BYTES of block
arrays, and is a multiple of the checksum unit. A window of W blocks drawn from S shards
makes a rank's next document come from its document's shard with P ~ 1/W + 1/S, S/W + 1
times a uniform order's 1/S. Cost: O(1) arithmetic a plan, per `loader.stats` and once
per sizing check (the plan's window blocks are worked out once: raypipe.sampling.run).
"""

from __future__ import annotations

from dataclasses import dataclass

from raypipe.sampling.blocks import BLOCK_ALIGN, MIXED_SHARDS, WindowLayout

MAX_GETS_A_SECOND = 10.0  # a rank's block reads a second the advice may cost
BLOCK_TABLE_BYTES = 256 << 20  # the plan's block arrays a node may hold (16 bytes a block)
BLOCK_RECORD_BYTES = 16  # a block's first document and shard (raypipe.sampling.blocks)
BETTER = 2.0  # advice mixes at least this many times closer to uniform


def times_uniform(shards: int, window_blocks: int) -> float:
    """P(a rank's next document comes from its document's shard) over a uniform order's:
    S/W + 1 for windows of W blocks from S shards."""
    return shards / max(window_blocks, 1) + 1


@dataclass(frozen=True)
class Mixing:
    """A windowed plan's mixing (`layout`) at a rank's measured `read_bytes_per_s`;
    `better_block_bytes` is the block size that mixes at least BETTER times as well within
    the request and memory bounds (0: none)."""

    layout: WindowLayout
    read_bytes_per_s: float

    @property
    def shards(self) -> int:
        return self.layout.shards

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def window_blocks(self) -> int:
        return self.layout.window_blocks

    @property
    def times_uniform(self) -> float:
        return times_uniform(self.shards, self.window_blocks)

    @property
    def least_block_bytes(self) -> int:
        """The smallest block the bounds allow: a rank's GETs a second at its read rate,
        the node's block arrays, the checksum unit."""
        by_rate = self.read_bytes_per_s / MAX_GETS_A_SECOND
        by_table = self.layout.cut_bytes * BLOCK_RECORD_BYTES / BLOCK_TABLE_BYTES
        return _aligned_up(max(by_rate, by_table, BLOCK_ALIGN))

    @property
    def better_block_bytes(self) -> int:
        """The largest block that makes windows of MIXED_SHARDS x the shards, or the
        smallest the bounds allow where that one is smaller; 0 where it mixes less than
        BETTER times as well as the plan's blocks."""
        if not self.shards or self.block_bytes <= 0:
            return 0
        wanted = self.window_blocks * self.block_bytes // (MIXED_SHARDS * self.shards)
        block = max(wanted // BLOCK_ALIGN * BLOCK_ALIGN, self.least_block_bytes)
        if block >= self.block_bytes:
            return 0
        if self.times_uniform < BETTER * times_uniform(self.shards, self.window_with(block)):
            return 0
        return block

    def window_with(self, block_bytes: int) -> int:
        """Blocks a window of the plan's bytes holds at `block_bytes` (a block passes its
        size by at most a document: the plan's window bytes are blocks x block_bytes)."""
        return max(1, self.window_blocks * self.block_bytes // block_bytes)

    def metrics(self) -> dict[str, float]:
        """Flat metrics: P(next document from its shard) over uniform, and the block size
        advised (0: none)."""
        return {"shard_mix_x_uniform": round(self.times_uniform, 1),
                "advised_block_bytes": self.better_block_bytes}

    def advice(self) -> str:
        """A line naming `better_block_bytes` and what it costs ("" where none)."""
        block = self.better_block_bytes
        if not block:
            return ""
        window = self.window_with(block)
        gets = self.read_bytes_per_s / block
        table = self.layout.cut_bytes / block * BLOCK_RECORD_BYTES
        return (f"{self.layout.root}: the windowed shuffle mixes {self.window_blocks:,} blocks of "
                f"{self.block_bytes:,} bytes a window from {self.shards:,} shards: a rank's "
                f"next document comes from its document's shard ~{self.times_uniform:,.0f}x "
                f"as often as in a uniform order. At this loop's read rate "
                f"({self.read_bytes_per_s / 1e3:,.1f} KB/s a rank), block_bytes={block} "
                f"makes windows of {window:,} blocks (~"
                f"{times_uniform(self.shards, window):,.0f}x) for {gets:.2f} GETs a second "
                f"a rank and {table / 1e6:,.0f} MB of block arrays a node: give it to a new "
                "run (a resumed run keeps its state's)")


def _aligned_up(size: float) -> int:
    return int(-(-int(size) // BLOCK_ALIGN) * BLOCK_ALIGN)
