"""How evenly a step's compute falls on its ranks under document-masked attention, from the
cost model (raypipe.sampling.balance), as the loader's bestfit serves rows: documents
packed by raypipe's own `fill` packing a block at a time (--block-documents), a block's
rows in a shuffled order, or in order of cost up and down by turns (`block_order="by_cost"`),
G = ranks x rows-a-rank consecutive rows a step. Per step, the slowest rank's cost over the
mean for `none` (row i x ranks + r on rank r), `attention` (the step's rows assigned by
cost: `balance="attention"`) and `attention` over blocks ordered by cost. FLOPs only: no
GPU, no kernel.

Then what balancing costs the thread that describes the steps (not the training thread):
the loader's own `rank_steps` and `describe` per step, with and without a balance, on a
synthetic dataset (--loader-tokens; 0 skips it), as a ratio to `none` in the same run.

Usage: python bench/balance_bench.py [--steps 512] [--hidden 4096]
    [--block-documents 4096,65536,1048576] [--loader-tokens 40000000] [--loader-seq-len 2048]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from common import synthetic_token_dataset

from raypipe.loader import open_loader
from raypipe.sampling.balance import AttentionCost, assign_rows, cost_order, rank_loads
from raypipe.sampling.pack import pack_fill


def web_lengths(count: int, rng: np.random.Generator) -> np.ndarray:
    """Web-like document lengths in tokens: lognormal, median ~700, a long tail."""
    return np.clip(rng.lognormal(6.5, 1.2, count), 16, 200_000).astype(np.int64)


def web_with_long(count: int, rng: np.random.Generator) -> np.ndarray:
    """The same with 20% long documents (median ~13,000 tokens: books, code files)."""
    lengths = web_lengths(count, rng)
    long = rng.random(count) < 0.2
    lengths[long] = np.clip(rng.lognormal(9.5, 0.8, int(long.sum())), 2_000, 200_000)
    return lengths


def block_costs(lengths: np.ndarray, seq_len: int, cost: AttentionCost,
                block_documents: int) -> list[np.ndarray]:
    """Every row's cost, block by block: `block_documents` documents packed with `fill`."""
    blocks = []
    for first in range(0, len(lengths), block_documents):
        documents = lengths[first:first + block_documents]
        packed = pack_fill(np.arange(len(documents), dtype=np.int64), documents, seq_len + 1)
        blocks.append(cost.row_costs(packed.row_offsets, packed.take, seq_len))
    return blocks


def served(blocks: list[np.ndarray], by_cost: bool, rng: np.random.Generator) -> np.ndarray:
    """The rows' costs in the order the plan serves them: each block's rows shuffled or
    (by_cost) ordered by cost, up in even blocks and down in odd ones."""
    out = []
    for index, costs in enumerate(blocks):
        shuffled = rng.permutation(len(costs))
        out.append(costs[cost_order(costs, shuffled, index % 2 == 1) if by_cost
                         else shuffled])
    return np.concatenate(out)


def spreads(costs: np.ndarray, ranks: int, per_rank: int, balance: str) -> np.ndarray:
    """Per step (every whole step of `costs`), the slowest rank's cost over the mean,
    minus 1."""
    width = ranks * per_rank
    out = np.empty(len(costs) // width)
    for step in range(len(out)):
        rows = costs[step * width:(step + 1) * width]
        order = assign_rows(rows, ranks) if balance == "attention" else None
        loads = rank_loads(rows, order, ranks)
        out[step] = loads.max() / loads.mean() - 1
    return out


def model_table(steps: int, hidden: int, sizes: list[int]) -> None:
    cost = AttentionCost.of_model(hidden)
    print(f"slowest rank over the mean, per step, over every step of a sample of at least "
          f"{steps} steps at 64 ranks and two blocks of each size (hidden {hidden}: "
          f"c = {cost.linear:,.0f})")
    print(f"{'lengths':<14} {'T':>6} {'ranks':>5} {'rows/rank':>9} {'balance':<9} "
          f"{'block_order':<11} {'block docs':>10} {'p50':>7} {'p99':>7} {'max':>7}")
    for name, draw in (("web", web_lengths), ("web+20% long", web_with_long)):
        for seq_len, per_rank in ((8192, 4), (32768, 1)):
            tokens = steps * 64 * per_rank * seq_len
            lengths = draw(max(int(tokens / 1100), 2 * max(sizes)), np.random.default_rng(7))
            packed = {size: block_costs(lengths, seq_len, cost, size) for size in sizes}
            for ranks in (8, 64):
                cells = [("none", False, sizes[0]), ("attention", False, sizes[0])]
                cells += [("attention", True, size) for size in sizes]
                for balance, by_cost, size in cells:
                    costs = served(packed[size], by_cost, np.random.default_rng(11))
                    found = spreads(costs, ranks, per_rank, balance)
                    p50, p99 = np.percentile(found, [50, 99])
                    order = "by_cost" if by_cost else "shuffled"
                    print(f"{name:<14} {seq_len:>6} {ranks:>5} {per_rank:>9} {balance:<9} "
                          f"{order:<11} {size:>10} {p50:>7.2%} {p99:>7.2%} "
                          f"{found.max():>7.2%}")


def describing_cost(path: Path, seq_len: int, world: int, knobs: dict, steps: int = 8
                    ) -> float:
    """Seconds a step on the describing thread: rank 0's positions (`rank_steps`) and
    their description, the steps after the first (the blocks the first packs are kept)."""
    loader = open_loader(path, seq_len, 4, rank=0, world_size=world, seed=1, **knobs)
    planned = loader.run.planned
    segment = next(planned.segments(loader.run.cursor()))
    steps = min(steps, segment.steps - 1)
    if steps < 1:
        raise SystemExit(f"{path}: fewer than 2 steps of {world} x 4 rows of {seq_len}")
    filler = planned.filler(segment.epoch, phases=segment.phases)
    filler.describe(planned.rank_steps(segment, 0, 1, 0))
    started = time.perf_counter()
    filler.describe(planned.rank_steps(segment, 1, 1 + steps, 0))
    return (time.perf_counter() - started) / steps


def loader_table(tokens: int, seq_len: int, workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    path = synthetic_token_dataset(workdir, tokens)
    print(f"\nthe describing thread, per step (T={seq_len}, 4 rows a rank, {tokens:,} "
          "tokens; ratio to none)")
    print(f"{'mode':<10} {'ranks':>5} {'none ms':>8} {'attention ms':>18} "
          f"{'+ by_cost ms':>18}")
    for mode in ("bestfit", "documents", "windows"):
        for world in (64, 512):
            base = describing_cost(path, seq_len, world, {"mode": mode})
            balanced = describing_cost(path, seq_len, world,
                                       {"mode": mode, "balance": "attention"})
            cells = f"{balanced * 1e3:>9.2f} ({balanced / base:>5.1f}x)"
            if mode == "bestfit":
                ordered = describing_cost(path, seq_len, world, {
                    "mode": mode, "balance": "attention", "block_order": "by_cost"})
                cells += f" {ordered * 1e3:>9.2f} ({ordered / base:>5.1f}x)"
            print(f"{mode:<10} {world:>5} {base * 1e3:>8.2f} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=4096, help="the model's hidden size "
                        "(the cost's linear term: 6 x it)")
    parser.add_argument("--block-documents", default="4096,65536,1048576",
                        help="documents a packing block holds, each a row of the table "
                        "under block_order by_cost")
    parser.add_argument("--loader-tokens", type=int, default=40_000_000)
    parser.add_argument("--loader-seq-len", type=int, default=2048)
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    started = time.perf_counter()
    model_table(args.steps, args.hidden, [int(b) for b in args.block_documents.split(",")])
    if args.loader_tokens:
        loader_table(args.loader_tokens, args.loader_seq_len, args.workdir)
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
