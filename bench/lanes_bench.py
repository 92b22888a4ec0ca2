"""What a change inside an epoch costs a rank under a windowed shuffle of several lanes:
documents excluded halfway through the epoch, then a seq_len change, each continuing every
lane's rest on its own (raypipe.sampling.modes.bestfit.LanedBestFitPlan), against one lane.

    python bench/lanes_bench.py [--documents 1000000] [--lanes 1,8,64,256] [--packing fill]

Synthetic web-like lengths (lognormal, mean ~650 tokens), 1,024 shards in windows of 4,
seq_len 2047 then 4095, 1,000 documents excluded. Every rank builds the whole continuation
(each lane's size places the positions), so the cost is per rank; printed with its ratio
to one lane's, measured in the same run.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from raypipe.sampling.blocks import whole_shards
from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.modes.base import PlanInputs, PlanSpec
from raypipe.sampling.modes.bestfit import BESTFIT
from raypipe.sampling.plans import ShardWindows

SHARDS, WINDOW_SHARDS, EXCLUDED = 1024, 4, 1000


class Separators:
    bos_id, eos_id = 1, None


def continuation_seconds(lengths: np.ndarray, lanes: int, packing: str) -> tuple[float, float]:
    """(seconds to continue the plan after an exclusion halfway, seconds for a seq_len
    change a third into that continuation), the node's block sums memo warm."""
    count = lengths.size
    shards = np.diff(np.append(np.arange(0, count, max(1, count // SHARDS)), count))
    groups = ShardWindows(whole_shards(shards), WINDOW_SHARDS, lanes)
    kept: dict[Any, np.ndarray] = {}

    def memo(key: Any, compute: Any) -> np.ndarray:
        if key not in kept:
            kept[key] = compute()
        return kept[key]

    def inputs(excluded: np.ndarray) -> PlanInputs:
        return PlanInputs(Separators(), lambda: DocumentLengths.of(lengths), groups=groups,
                          memo=memo, excluded=excluded)

    def spec(seq_len: int) -> PlanSpec:
        return PlanSpec.of(seq_len=seq_len, seed=1, packing=packing, shuffle="windowed")

    plan = BESTFIT.plan(spec(2047), inputs(np.zeros(0, dtype=np.int64)), 0)
    excluded = np.sort(np.random.default_rng(1).choice(count, EXCLUDED, replace=False))
    started = time.perf_counter()
    continued = BESTFIT.continue_plan(spec(2047), inputs(excluded), 0, plan, plan.size // 2)
    assert continued.size > 0
    excluding = time.perf_counter() - started
    started = time.perf_counter()
    longer = BESTFIT.continue_plan(spec(4095), inputs(excluded), 0, continued,
                                   continued.size // 3)
    assert longer.size > 0
    return excluding, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--lanes", default="1,8,64,256")
    parser.add_argument("--packing", default="fill")
    args = parser.parse_args()
    lengths = np.clip(np.random.default_rng(0).lognormal(6, 1, args.documents), 1,
                      100_000).astype(np.int64)
    lanes = [int(value) for value in args.lanes.split(",")]
    print(f"{args.documents:,} documents, packing {args.packing}: a rank's cost of a change "
          "inside the epoch")
    print(f"{'lanes':>6} {'exclusion s':>12} {'x 1 lane':>9} {'seq_len s':>10} {'x 1 lane':>9}")
    base = None
    for count in [1, *[lane for lane in lanes if lane != 1]]:
        excluding, longer = continuation_seconds(lengths, count, args.packing)
        base = base or (excluding, longer)
        print(f"{count:>6} {excluding:>12.3f} {excluding / base[0]:>9.1f} {longer:>10.3f} "
              f"{longer / base[1]:>9.1f}")


if __name__ == "__main__":
    main()
