"""Who reads the longer lanes' rest at an epoch's end under a windowed shuffle of many lanes:
`lane_ends="nearby"` (windows laid out for the lanes; the rest cut into one run a rank)
against `"spread"` (the layout before: the rest read lane after lane by every rank),
measured in the same run on the same blocks.

    python bench/lane_ends_bench.py [--blocks 20000,100000] [--lanes 1000] [--per-node 8]

Blocks hold the documents of 64 Ki tokens of web-like lengths (lognormal, mean ~650
tokens), so their document counts vary as a real cut's do; windows of 16 blocks; a
document a row (documents mode: the observations are documents). Printed per layout: the
rest (observations past the side-by-side part) as a share of the epoch, the share of the
epoch a rank reads from a lane of another node, and how many nodes read each lane's rest
(each such node fetches blocks of that lane's last window).
"""

from __future__ import annotations

import argparse

import numpy as np

from raypipe.sampling.permute import WindowedPermutation
from raypipe.sampling.plans import LaneOrder, lane_bounds

BLOCK_TOKENS, WINDOW_BLOCKS = 65536, 16


def block_documents(blocks: int, seed: int = 0) -> np.ndarray:
    """Documents per block: web-like lengths laid end to end, cut every BLOCK_TOKENS."""
    rng = np.random.default_rng(seed)
    mean = 650
    lengths = rng.lognormal(np.log(mean) - 0.5, 1.0, int(blocks * BLOCK_TOKENS / mean * 1.1))
    ends = np.cumsum(np.maximum(lengths, 1).astype(np.int64))
    cuts = np.searchsorted(ends, np.arange(1, blocks + 1) * BLOCK_TOKENS)
    return np.maximum(np.diff(np.concatenate([[0], cuts])), 1)


def lane_ends(counts: np.ndarray, lanes: int, per_node: int, nearby: bool
              ) -> tuple[float, float, float, int]:
    """(the rest's share of the epoch, the share read from another node's lane, nodes
    reading a lane's rest: mean and most)."""
    order = WindowedPermutation(counts, WINDOW_BLOCKS, seed=1, lanes=lanes if nearby else 0)
    lane_order = LaneOrder(lane_bounds(order.window_starts, lanes, lambda starts: starts),
                           nearby=nearby)
    total = len(order)
    positions = np.arange(lane_order.even, total, dtype=np.int64)
    lane = np.searchsorted(lane_order.bounds, lane_order(positions), side="right") - 1
    node = (positions % lanes) // per_node
    foreign = int(np.count_nonzero(lane // per_node != node))
    pairs = np.unique(lane * lanes + node)
    readers = np.bincount(pairs // lanes, minlength=lanes)
    readers = readers[readers > 0]
    return (positions.size / total, foreign / total,
            float(readers.mean()) if readers.size else 0.0,
            int(readers.max()) if readers.size else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="20000,100000")
    parser.add_argument("--lanes", type=int, default=1000)
    parser.add_argument("--per-node", type=int, default=8)
    args = parser.parse_args()
    print(f"{args.lanes} lanes, {args.per_node} ranks a node, windows of {WINDOW_BLOCKS} "
          f"blocks of {BLOCK_TOKENS:,} tokens")
    print(f"{'blocks':>9} {'lane_ends':>9} {'rest':>7} {'other node':>10} "
          f"{'nodes/rest':>10} {'most':>5} {'vs spread':>9}")
    for blocks in (int(value) for value in args.blocks.split(",")):
        counts = block_documents(blocks)
        spread = lane_ends(counts, args.lanes, args.per_node, nearby=False)
        for name, figures in (("spread", spread),
                              ("nearby", lane_ends(counts, args.lanes, args.per_node, True))):
            rest, foreign, readers, most = figures
            print(f"{blocks:>9,} {name:>9} {rest:>7.2%} {foreign:>10.2%} {readers:>10.1f} "
                  f"{most:>5} {readers / max(spread[2], 1e-9):>8.2f}x")


if __name__ == "__main__":
    main()
