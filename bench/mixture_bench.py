"""Mixture benchmark: a loader (open_loader) over a two-source mixture against the same loader over
one source, bestfit and windows, T=2048, B=8.

    python bench/mixture_bench.py [--tokens 40_000_000] [--workdir bench_out]

Two synthetic Megatron datasets (random uint16 tokens, lognormal documents) of --tokens
each; the baseline reads one of them, the mixture reads both at 0.7 / 0.3. Each contender
runs --steps steps, alternated, best of --repeats. Prints tokens/s and the mixture's cost per
batch over one source (target: within 1.5x of one source's time per batch).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import print_table, synthetic_token_dataset

from raypipe.loader import open_loader

SEQ, BATCH = 2048, 8


def seconds_per_batch(path, steps: int, mode: str, **options) -> float:
    loader = open_loader(path, SEQ, BATCH, mode=mode, **options)
    iterator = iter(loader)
    int(next(iterator).inputs[0, 0])  # plans and shards opened outside the timing
    began = time.perf_counter()
    for _ in range(steps):
        int(next(iterator).inputs[0, 0])
    return (time.perf_counter() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40_000_000)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    web = synthetic_token_dataset(args.workdir, args.tokens, seed=0)
    code = synthetic_token_dataset(args.workdir, args.tokens, seed=1)
    mixture = {"web": str(web), "code": str(code)}
    rows = [("mode", "one source us/batch", "mixture us/batch", "mixture / one",
             "mixture M tokens/s")]
    for mode in ("bestfit", "windows"):
        single, mixed = [], []
        for _ in range(args.repeats):
            single.append(seconds_per_batch(web, args.steps, mode))
            mixed.append(seconds_per_batch(mixture, args.steps, mode,
                                           weights={"web": 0.7, "code": 0.3}))
        one, both = min(single), min(mixed)
        rows.append((mode, f"{one * 1e6:.0f}", f"{both * 1e6:.0f}", f"{both / one:.2f}",
                     f"{BATCH * SEQ / both / 1e6:.1f}"))
    print(f"two synthetic sources of {args.tokens:,} tokens, T={SEQ}, B={BATCH}, "
          f"{args.steps} steps, best of {args.repeats}")
    print_table(rows)


if __name__ == "__main__":
    main()
