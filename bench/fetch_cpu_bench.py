"""Fetch CPU bench: what reading a bucket a block at a time costs the training process in
CPU, against the same epoch read from the local copy, measured in the same run.

    python bench/fetch_cpu_bench.py [--shards 40 400] [--share 0.1]

It starts a moto S3 server on 127.0.0.1 (its own process: its CPU is not counted), uploads
a dataset of small Megatron shards (~75 K tokens each) and reads one epoch with one rank
(bestfit T=2048, 4 rows, the default `shuffle="auto"`: windowed blocks sized from a cache
of --share of the data), with no consumer step. It prints, per dataset, the process's CPU
(user + system, every thread) for the open and first batch and for the rest of the epoch,
the fetches after the first batch, the CPU a fetch costs past the local epoch's, and the
bucket epoch's CPU over the local one's.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import time
from pathlib import Path

from common import print_table, synthetic_token_dataset
from object_storage_bench import start_moto, upload

from raypipe.loader import open_loader

SEQ, BATCH, SEED, SHARD_TOKENS = 2048, 4, 7, 75_000


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def fetches(loader) -> int:
    return sum(dataset.cache.stats.downloads for dataset in loader._datasets())


def bucket_epoch(uri: str, cache: Path, budget: int) -> dict:
    """One epoch from the bucket: CPU at the first batch and after, fetches, knobs."""
    shutil.rmtree(cache, ignore_errors=True)
    began = cpu_seconds()
    loader = open_loader(uri, SEQ, BATCH, seed=SEED, cache_dir=str(cache), cache_bytes=budget)
    batches = iter(loader)
    next(batches)
    first, fetched_first = cpu_seconds(), fetches(loader)
    steps = 1 + sum(1 for _ in batches)
    done = cpu_seconds()
    result = {"steps": steps, "open_s": first - began, "rest_s": done - first,
              "fetches": fetches(loader) - fetched_first,
              "knobs": loader.state_dict()["knobs"]}
    loader.close()
    return result


def local_epoch(path: Path, knobs: dict) -> float:
    """The same epoch from the local copy, given the bucket run's layout: CPU seconds."""
    layout = {name: knobs[name] for name in ("shuffle", "block_bytes", "window_blocks",
                                             "lanes") if name in knobs}
    began = cpu_seconds()
    loader = open_loader(str(path), SEQ, BATCH, seed=SEED, **layout)
    sum(1 for _ in loader)
    return cpu_seconds() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[40, 400])
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--workdir", default="bench_out/fetch_cpu")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    server = start_moto()
    rows = [("shards", "block x window", "steps", "open + first batch s", "rest of epoch s",
             "fetches", "CPU a fetch past local (ms)", "bucket / local CPU")]
    try:
        import boto3

        boto3.client("s3").create_bucket(Bucket="raypipe-fetch-cpu")
        for shards in args.shards:
            local = synthetic_token_dataset(workdir, shards * SHARD_TOKENS, 3, SHARD_TOKENS,
                                            "megatron", False)
            uri = f"s3://raypipe-fetch-cpu/{local.name}"
            size = upload(local, uri)
            began = time.perf_counter()
            run = bucket_epoch(uri, workdir / "cache", int(size * args.share))
            local_s = local_epoch(local, run["knobs"])
            bucket_s = run["open_s"] + run["rest_s"]
            per_fetch = (run["rest_s"] - local_s) / max(run["fetches"], 1)
            knobs = run["knobs"]
            rows.append((f"{shards}", f"{knobs.get('block_bytes', 0) / 1e3:,.0f} KB x "
                         f"{knobs.get('window_blocks', '-')}", f"{run['steps']}",
                         f"{run['open_s']:.2f}", f"{run['rest_s']:.2f}", f"{run['fetches']}",
                         f"{1000 * per_fetch:.1f}", f"{bucket_s / local_s:.1f}x"))
            print(f"  {shards} shards: {time.perf_counter() - began:.0f} s", flush=True)
    finally:
        if server is not None:
            server.terminate()
    print_table(rows)


if __name__ == "__main__":
    main()
