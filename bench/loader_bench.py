"""Loader benchmark: tokens/s of raypipe's TokenLoader against a raw memmap baseline and
Ray Data's `iter_torch_batches`, on a token dataset of hundreds of MB (seq_len 2048, batch 8).

    python bench/loader_bench.py [--tokens 150_000_000] [--workdir bench_out]

Each contender runs --repeats times, alternated, on a warm page cache; the best is kept.
Prints from one run, side by side: the baseline (random 2049-token windows copied out of a
numpy memmap into a preallocated tensor, tight loop, no threads); Ray Data's
iter_torch_batches over the same tokens (rows of 2049); raypipe windows and bestfit modes
consumed by a training-like loop; the ratios (targets: windows >= 0.5x baseline and >= 3x
Ray Data, bestfit >= 50 M tokens/s); peak private memory for two dataset sizes 10x apart;
the padding of bestfit's fill packing (default) and the tokens crop packing leaves untrained
next to nanochat's algorithm on the same documents and T (bench/packing_bench.py compares
every packing on real and synthetic corpora).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import anon_rss_mib, print_table, synthetic_token_dataset
from nanochat_reference import nanochat_bestfit_crop

from raypipe.loader import TokenLoader

SEQ, BATCH = 2048, 8


def memmap_baseline(path: Path, batches: int) -> float:
    from raypipe.dataset import TokenDataset

    tokens = TokenDataset(path).reader(0).tokens
    out = torch.empty((BATCH, SEQ + 1), dtype=torch.int64)
    view = out.numpy()
    rng = np.random.default_rng(0)
    starts = rng.integers(0, tokens.size - SEQ - 1, (batches, BATCH))
    began = time.perf_counter()
    for row_starts in starts:
        for row, start in enumerate(row_starts):
            view[row] = tokens[start:start + SEQ + 1]
        int(out[0, 0])
    return batches * BATCH * SEQ / (time.perf_counter() - began)


def loader_rate(path: Path, mode: str, batches: int) -> tuple[float, float]:
    loader = TokenLoader(path, SEQ, BATCH, mode=mode, seed=1)
    plan_began = time.perf_counter()
    loader.steps_in_epoch()  # bestfit plans the epoch here (reported apart)
    plan_seconds = time.perf_counter() - plan_began
    iterator = iter(loader)
    for _ in range(20):  # warm-up: thread start, first block
        next(iterator)
    began = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
        int(batch.inputs[0, 0])  # a training step would read the batch here
    rate = batches * BATCH * SEQ / (time.perf_counter() - began)
    iterator.close()
    return rate, plan_seconds


def ray_data_rate(path: Path, batches: int) -> float:
    import ray

    from raypipe.dataset import TokenDataset

    tokens = TokenDataset(path).reader(0).tokens
    rows = (batches + 20) * BATCH
    windows = np.asarray(tokens[:rows * (SEQ + 1)], dtype=np.int64).reshape(rows, SEQ + 1)
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    try:
        dataset = ray.data.from_numpy(windows).materialize()
        iterator = iter(dataset.iter_torch_batches(batch_size=BATCH))
        for _ in range(20):
            next(iterator)
        began = time.perf_counter()
        for _ in range(batches):
            batch = next(iterator)
            int(batch["data"][0, 0])
        rate = batches * BATCH * SEQ / (time.perf_counter() - began)
        del iterator, dataset
        return rate
    finally:
        ray.shutdown()


def memory_probe(path: str) -> None:
    """Child process: run both modes over part of an epoch, print peak private memory."""
    peak = anon_rss_mib()
    for mode in ("windows", "bestfit"):
        loader = TokenLoader(path, SEQ, BATCH, mode=mode, seed=1)
        for step, batch in enumerate(loader):
            int(batch.inputs[0, 0])
            if step % 50 == 0:
                peak = max(peak, anon_rss_mib())
            if step == 1000:
                break
    print(json.dumps({"peak_anon_mib": peak}))


def waste_comparison(path: Path) -> tuple[float, float, float]:
    """(fill's padding, crop's untrained tokens, nanochat's crop) on the same 32k documents
    in one order."""
    from raypipe.sampling.modes.bestfit import BestFitPlan

    plan = TokenLoader(path, SEQ, BATCH, mode="bestfit", seed=1).plan()
    order = np.concatenate([plan.block_documents_ids(b) for b in range(min(plan.num_blocks, 8))])
    lengths = plan.lengths[order]
    fill = BestFitPlan(lengths, SEQ, seed=0, epoch=0).report()
    crop = BestFitPlan(lengths, SEQ, seed=0, epoch=0, packing="crop").report()
    reference = nanochat_bestfit_crop(lengths, SEQ + 1)
    return (fill.padding_fraction, crop.untrained_fraction,
            reference["cropped"] / int(lengths.sum()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=150_000_000)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    parser.add_argument("--repeats", type=int, default=2, help="best of N per contender")
    parser.add_argument("--memory-probe")
    args = parser.parse_args()
    if args.memory_probe:
        memory_probe(args.memory_probe)
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback
    args.workdir.mkdir(exist_ok=True)
    big = synthetic_token_dataset(args.workdir, args.tokens)
    small = synthetic_token_dataset(args.workdir, args.tokens // 10)
    size_mb = sum(p.stat().st_size for p in big.rglob("*.bin")) / 1e6
    print(f"dataset: {big} ({size_mb:.0f} MB of uint16 tokens), seq_len {SEQ}, batch {BATCH}")

    for path in big.rglob("*.bin"):  # page cache warm for every contender
        with open(path, "rb") as handle:
            while handle.read(64 << 20):
                pass
    baseline = windows = bestfit = 0.0
    for _ in range(args.repeats):  # alternate and keep the best of each: shared, noisy cores
        baseline = max(baseline, memmap_baseline(big, args.batches))
        windows = max(windows, loader_rate(big, "windows", args.batches)[0])
        rate, plan_seconds = loader_rate(big, "bestfit", args.batches)
        bestfit = max(bestfit, rate)
    ray_rate = ray_data_rate(big, min(args.batches, 1500))
    print_table([
        ("what", "M tokens/s", "vs baseline", "vs Ray Data"),
        ("baseline: memmap random windows", f"{baseline / 1e6:.0f}", "1.00",
         f"{baseline / ray_rate:.2f}"),
        ("Ray Data iter_torch_batches", f"{ray_rate / 1e6:.0f}", f"{ray_rate / baseline:.2f}",
         "1.00"),
        ("raypipe windows", f"{windows / 1e6:.0f}", f"{windows / baseline:.2f}",
         f"{windows / ray_rate:.2f}"),
        ("raypipe bestfit", f"{bestfit / 1e6:.0f}", f"{bestfit / baseline:.2f}",
         f"{bestfit / ray_rate:.2f}"),
    ])
    print(f"bestfit epoch plan: {plan_seconds:.2f} s once per epoch (not in the rate)")
    peaks = {}
    for name, path in (("small", small), ("big", big)):
        out = subprocess.run([sys.executable, __file__, "--memory-probe", str(path)],
                             capture_output=True, text=True, check=True).stdout
        peaks[name] = json.loads(out.strip().splitlines()[-1])["peak_anon_mib"]
    print(f"peak private memory of a loader process: {args.tokens // 10 // 1_000_000} M tokens "
          f"-> {peaks['small']:.0f} MiB, {args.tokens // 1_000_000} M tokens -> "
          f"{peaks['big']:.0f} MiB (ratio {peaks['big'] / peaks['small']:.2f})")
    padding, ours, reference = waste_comparison(big)
    print(f"at T={SEQ}: raypipe fill pads {padding:.4f} of the positions; tokens not trained: "
          f"raypipe crop {ours:.4f} vs nanochat (1000-doc buffer) {reference:.4f}")
    verdicts = [windows >= 0.5 * baseline, windows >= 3 * ray_rate, bestfit >= 50e6,
                ours <= reference, padding <= 0.005]
    print("TARGETS " + ("PASS" if all(verdicts) else f"MISSED {verdicts}"))


if __name__ == "__main__":
    main()
