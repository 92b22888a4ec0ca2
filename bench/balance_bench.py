"""How evenly a step's compute falls on its ranks under document-masked attention, from the
cost model (raypipe.sampling.balance): rows packed by raypipe's own `fill` packing from two
length distributions, taken in a shuffled order as the loader serves them, and the slowest
rank's cost over the mean, per step, for `none` (rows in the plan's order) and `attention`
(rows grouped by cost over a window of steps, then assigned within each step by cost; a
window of 1: within each step alone). FLOPs only: no GPU, no kernel.

Usage: python bench/balance_bench.py [--steps 512] [--hidden 4096] [--windows 1,16,256]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from raypipe.sampling.balance import AttentionCost, assign_rows, group_steps, rank_loads
from raypipe.sampling.pack import pack_fill

BLOCK_DOCUMENTS = 4096  # documents packed together, as the loader's bestfit blocks


def web_lengths(count: int, rng: np.random.Generator) -> np.ndarray:
    """Web-like document lengths in tokens: lognormal, median ~700, a long tail."""
    return np.clip(rng.lognormal(6.5, 1.2, count), 16, 200_000).astype(np.int64)


def web_with_long(count: int, rng: np.random.Generator) -> np.ndarray:
    """The same with 20% long documents (median ~13,000 tokens: books, code files)."""
    lengths = web_lengths(count, rng)
    long = rng.random(count) < 0.2
    lengths[long] = np.clip(rng.lognormal(9.5, 0.8, int(long.sum())), 2_000, 200_000)
    return lengths


def packed_row_costs(lengths: np.ndarray, seq_len: int, cost: AttentionCost,
                     rng: np.random.Generator) -> np.ndarray:
    """Every row's cost, rows packed block by block with `fill`, in a shuffled order."""
    costs = []
    for first in range(0, len(lengths), BLOCK_DOCUMENTS):
        block = lengths[first:first + BLOCK_DOCUMENTS]
        packed = pack_fill(np.arange(len(block), dtype=np.int64), block, seq_len + 1)
        costs.append(cost.row_costs(packed.row_offsets, packed.take, seq_len))
    every = np.concatenate(costs)
    return every[rng.permutation(len(every))]


def spreads(costs: np.ndarray, ranks: int, per_rank: int, balance: str,
            window: int) -> np.ndarray:
    """Per step, the slowest rank's cost over the mean, minus 1."""
    width = ranks * per_rank
    steps = len(costs) // width
    if balance == "attention" and window > 1:
        windows = steps // window
        for index in range(windows):  # rows grouped over a window of steps
            span = slice(index * window * width, (index + 1) * window * width)
            order = np.random.default_rng(index).permutation(window)
            costs[span] = costs[span][group_steps(costs[span], window, order)]
    out = np.empty(steps)
    for step in range(steps):
        rows = costs[step * width:(step + 1) * width]
        order = assign_rows(rows, ranks) if balance == "attention" else None
        loads = rank_loads(rows, order, ranks)
        out[step] = loads.max() / loads.mean() - 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=4096, help="the model's hidden size "
                        "(the cost's linear term: 6 x it)")
    parser.add_argument("--windows", default="1,16,256",
                        help="steps a window groups rows over, each a row of the table")
    args = parser.parse_args()
    cost = AttentionCost.of_model(args.hidden)
    started = time.perf_counter()
    windows = [int(w) for w in args.windows.split(",")]
    print(f"slowest rank over the mean, per step, {args.steps} steps (hidden {args.hidden}: "
          f"c = {cost.linear:,.0f})")
    print(f"{'lengths':<14} {'T':>6} {'ranks':>5} {'rows/rank':>9} {'balance':<9} "
          f"{'window':>6} {'p50':>7} {'p99':>7} {'max':>7}")
    for name, draw in (("web", web_lengths), ("web+20% long", web_with_long)):
        for seq_len, per_rank in ((8192, 4), (32768, 1)):
            for ranks in (8, 64):
                rng = np.random.default_rng(7)
                tokens = args.steps * ranks * per_rank * seq_len
                lengths = draw(int(tokens / 1200) + BLOCK_DOCUMENTS, rng)
                costs = packed_row_costs(lengths, seq_len, cost, rng)
                usable = args.steps * ranks * per_rank
                if len(costs) < usable:
                    raise SystemExit(f"{name}: {len(costs)} rows, fewer than {usable}")
                for balance, window in [("none", 1)] + [("attention", w) for w in windows]:
                    found = spreads(costs[:usable].copy(), ranks, per_rank, balance, window)
                    p50, p99 = np.percentile(found, [50, 99])
                    print(f"{name:<14} {seq_len:>6} {ranks:>5} {per_rank:>9} {balance:<9} "
                          f"{window:>6} {p50:>7.2%} {p99:>7.2%} {found.max():>7.2%}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
