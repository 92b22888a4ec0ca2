"""Every token once: one epoch under a batch ramp and a seq_len change, interrupted twice and
resumed at other world sizes, its tokens counted per document.

    python bench/every_token_once.py [DATA] [--seq-lens 512,2048] [--ramp 24,96,24,4]
        [--worlds 2,3,1] [--stops 0.45,0.7] [--on-resume] [--balance attention]
        [--block-order by_cost] [--shuffle windowed --lanes 2] [--tokens 4000000]

DATA is a raypipe output (default: a synthetic one of --tokens tokens, built once in
--workdir). seq_len is the first of --seq-lens for the first third of the epoch's tokens
and the second after it (declared as a schedule by tokens trained; with --on-resume the
change is not declared: the run after the first stop is constructed with the long seq_len
and loads the state). The global batch ramps from START to END rows, INCREMENT more every
STEPS steps (--ramp START,END,INCREMENT,STEPS; every stage a multiple of each world size).
The runs take --worlds ranks in turn, each to the step at its --stops fraction of the
uninterrupted epoch's steps, the last to the epoch's end. --balance spreads each step's rows
over its ranks by cost (the loader's `balance` knob; default none), --block-order by_cost
orders a packing block's rows by it (bestfit's `block_order`); --shuffle windowed --lanes L
reads windows of blocks in L lanes side by side (the seq_len change then continues each
lane's rest on its own).

Checks, each printed, exit status 1 when one fails:
- each step's rows (their tokens, as a multiset over the ranks) equal the uninterrupted
  run's at that step, and the step's seq_len is the schedule's;
- `raypipe.trace` of every step, from the final state's history, names pieces whose tokens
  (read from the dataset) are the step's rows, padding aside;
- counted over those pieces, every token of every document is trained exactly once, but the
  drop-last tail's, which the loader reports (`loader.dropped_tail`).
The dataset's tokens are held in memory (a check for datasets up to ~10^8 tokens).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from common import synthetic_token_dataset

from raypipe.dataset import TokenDataset
from raypipe.loader import TokenLoader
from raypipe.sampling.schedule import BatchSchedule, seq_len_stages_by_tokens
from raypipe.tools.trace import trace

Rows = dict[int, tuple[int, Counter]]  # step -> (seq_len, multiset of row digests)


def row_digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.int64).tobytes(),
                           digest_size=16).digest()


def run(path: str, world: int, state: dict | None, stop: int | None, options: dict
        ) -> tuple[Rows, dict, TokenLoader]:
    """Steps of `world` ranks from `state` up to global step `stop` (None: the epoch's end):
    their rows, the state after, and rank 0's loader."""
    loaders = [TokenLoader(path, rank=rank, world_size=world, device="cpu", **options)
               for rank in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    rows: Rows = {}
    while stop is None or loaders[0].steps < stop:
        batches = [next(iterator, None) for iterator in iterators]
        if batches[0] is None:
            break
        digests = Counter(row_digest(row) for batch in batches
                          for row in torch.cat([batch.inputs, batch.targets[:, -1:]], 1).numpy())
        rows[batches[0].step] = (batches[0].inputs.shape[1], digests)
    for iterator in iterators:
        iterator.close()
    return rows, loaders[0].state_dict(), loaders[0]


def traced_steps(path: str, steps: list[int], history: dict, tokens: np.ndarray,
                 starts: np.ndarray) -> tuple[Rows, np.ndarray]:
    """Each step's rows rebuilt from `raypipe.trace`'s pieces (the dataset's tokens at the
    pieces' columns, pad 0 elsewhere), and how many times each token of the dataset is in
    a piece."""
    counts = np.zeros(tokens.size, dtype=np.int32)
    rows: Rows = {}
    for step in steps:
        built: dict[tuple[int, int], np.ndarray] = {}
        seq_len = 0
        for record in trace(path, step, history=history):
            first = int(starts[record.document])
            piece = tokens[first + record.token_start:first + record.token_end]
            key = (record.rank, record.row)
            if key not in built:
                seq_len = seq_len or int(history_seq_len(history, step))
                built[key] = np.zeros(seq_len + 1, dtype=np.int64)
            built[key][record.col_start:record.col_end] = piece
            counts[first + record.token_start:first + record.token_end] += 1
        rows[step] = (seq_len, Counter(row_digest(row) for row in built.values()))
    return rows, counts


def history_seq_len(state: dict, step: int) -> int:
    """The seq_len the state's history gives step `step`."""
    return [entry[2] for entry in state["history"] if entry[0] <= step][-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="?", default=None)
    parser.add_argument("--seq-lens", default="512,2048")
    parser.add_argument("--ramp", default="24,96,24,4")
    parser.add_argument("--worlds", default="2,3,1")
    parser.add_argument("--stops", default="0.45,0.7")
    parser.add_argument("--on-resume", action="store_true",
                        help="make the seq_len change on resume at the first stop, undeclared")
    parser.add_argument("--balance", default="none",
                        help="the loader's balance (none, or a cost model: attention)")
    parser.add_argument("--block-order", default="shuffled",
                        help="bestfit's block_order (shuffled, or by_cost: needs --balance)")
    parser.add_argument("--shuffle", default="global", help="global, or windowed")
    parser.add_argument("--lanes", type=int, default=0,
                        help="a windowed shuffle's lanes (0: the first world size)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4_000_000)
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    short, long = (int(value) for value in args.seq_lens.split(","))
    start, end, increment, every = (int(value) for value in args.ramp.split(","))
    worlds = [int(value) for value in args.worlds.split(",")]
    stops = [float(value) for value in args.stops.split(",")]
    if len(stops) != len(worlds) - 1:
        parser.error("--stops: one fraction per run but the last")
    if args.data is None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        args.data = str(synthetic_token_dataset(args.workdir, args.tokens))
    dataset = TokenDataset(args.data)
    tokens = np.concatenate(list(dataset.iter_documents())).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(dataset.document_lengths())[:-1]])
    ramp = BatchSchedule.ramp(start, end, increment, every)
    by_tokens = seq_len_stages_by_tokens([(0, short), (tokens.size // 3, long)],
                                         BatchSchedule.of(ramp, 1))
    shape = {"seed": args.seed, "batch_schedule": ramp, "balance": args.balance,
             "block_order": args.block_order, "shuffle": args.shuffle,
             **({"lanes": args.lanes or worlds[0]} if args.shuffle == "windowed" else {})}
    declared = {**shape, "seq_len_schedule": by_tokens}
    whole, _, _ = run(args.data, worlds[0], None, None, declared)
    steps = len(whole)
    stop_steps = [int(fraction * steps) for fraction in stops]
    change = stop_steps[0] if args.on_resume else by_tokens[1][0]
    if args.on_resume:  # the uninterrupted run to compare with: the same change declared
        whole, _, _ = run(args.data, worlds[0], None, None,
                          {**shape, "seq_len_schedule": [(0, short), (change, long)]})
    print(f"{args.data}: {len(starts):,} documents, {tokens.size:,} tokens; one epoch of "
          f"{len(whole)} steps")
    print(f"schedule: global batch {start} -> {end} rows (+{increment} every {every} steps); "
          f"seq_len {short} -> {long} at step {change} "
          + ("(made on resume, undeclared)" if args.on_resume
             else "(declared: a third of the tokens trained)")
          + f"; balance {args.balance}, block_order {args.block_order}, shuffle "
          + (f"windowed in {shape['lanes']} lanes" if args.shuffle == "windowed"
             else args.shuffle))
    served: Rows = {}
    state = None
    for index, world in enumerate(worlds):
        stop = stop_steps[index] if index < len(stop_steps) else None
        options = declared
        if args.on_resume:
            options = {**shape, "seq_len": short if index == 0 else long}
        rows, state, loader = run(args.data, world, state, stop, options)
        served.update(rows)
        print(f"run {index + 1}: {world} ranks, steps {min(rows)}-{max(rows)}")
    same = sorted(served) == sorted(whole) and all(served[s] == whole[s] for s in whole)
    print(f"every step's rows and seq_len equal the uninterrupted run's: {same}")
    traced, counts = traced_steps(args.data, sorted(served), state, tokens, starts)
    held = all(traced[s] == served[s] for s in served)
    print(f"trace of every step (from the final state's history) rebuilds its rows: {held}")
    epoch, tail_rows, tail_tokens = loader.dropped_tail
    once, twice, never = (int((counts == 1).sum()), int((counts > 1).sum()),
                          int((counts == 0).sum()))
    print(f"tokens trained once {once:,} ({once / tokens.size:.4%}), more than once {twice:,}, "
          f"never {never:,}; the loader's drop-last tail of epoch {epoch}: {tail_rows} rows, "
          f"{tail_tokens:,} tokens")
    exact = twice == 0 and never == tail_tokens
    print("EVERY TOKEN ONCE: " + ("PASS" if same and held and exact else "FAIL"))
    return 0 if same and held and exact else 1


if __name__ == "__main__":
    sys.exit(main())
