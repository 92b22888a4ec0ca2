"""Object storage benchmark: TokenLoader reading `s3://` through the node-local cache, cold
and warm, against the same loader on a local memmap; and the bytes one node downloads per
epoch under the global and the shard-local shuffle when the cache holds a quarter of the data.

    python bench/object_storage_bench.py [--tokens 40_000_000] [--workdir bench_out]

Without AWS_ENDPOINT_URL it starts a moto S3 server on 127.0.0.1 (a Python server: its
throughput, not S3's, bounds the cold figure). Prints, from one run: tokens/s of the local
loader (the baseline), each timed over one epoch from the loader's construction, of a
cold cache (every shard downloaded and checksummed on first use)
and of a warm cache (a new loader over the filled cache), as ratios to the baseline (target:
warm >= 0.8x); then downloaded bytes per epoch / dataset bytes for both shuffles (target:
shard-local = 1.0x, each shard once).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import free_port, print_table, synthetic_token_dataset

from raypipe.io.manifest import read_manifest
from raypipe.io.store import Store
from raypipe.loader import TokenLoader

SEQ, BATCH = 2048, 8


def start_moto() -> subprocess.Popen | None:
    if os.environ.get("AWS_ENDPOINT_URL"):
        return None
    port = free_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("moto server did not start")


def upload(local: Path, uri: str) -> int:
    """Copy a dataset to object storage, manifest last; return its bytes."""
    import boto3

    bucket = uri.split("://", 1)[1].split("/", 1)[0]
    client = boto3.client("s3")
    if bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket=bucket)
    store = Store(uri)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != "manifest.json")
    for path in [*files, local / "manifest.json"]:
        store.upload(path, str(path.relative_to(local)))
    return sum(p.stat().st_size for p in files)


def tokens_per_second(path: str | Path, **options) -> tuple[float, TokenLoader]:
    """One epoch, timed from the loader's construction (opening shards included)."""
    began, done = time.perf_counter(), 0
    loader = TokenLoader(path, SEQ, BATCH, mode="windows", **options)
    for batch in loader:
        int(batch.inputs[0, 0])
        done += 1
    return done * BATCH * SEQ / (time.perf_counter() - began), loader


def bytes_per_epoch(uri: str, cache: Path, budget: int, shuffle: str) -> int:
    shutil.rmtree(cache, ignore_errors=True)
    loader = TokenLoader(uri, SEQ, BATCH, mode="windows", shuffle=shuffle, group_shards=1,
                         cache_dir=cache, cache_bytes=budget)
    for batch in loader:
        int(batch.inputs[0, 0])
    loader.close()
    return loader.cache_stats.downloaded_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40_000_000)
    parser.add_argument("--epoch-tokens", type=int, default=8_000_000)
    parser.add_argument("--workdir", default="bench_out")
    parser.add_argument("--bucket", default="raypipe-bench")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    server = start_moto()
    try:
        local = synthetic_token_dataset(workdir, args.tokens, shard_tokens=2_000_000)
        uri = f"s3://{args.bucket}/speed-{args.tokens}"
        size = upload(local, uri)
        cache = workdir / "cache-speed"
        shutil.rmtree(cache, ignore_errors=True)
        base, _ = tokens_per_second(local)
        cold, loader = tokens_per_second(uri, cache_dir=cache)
        downloaded = loader.cache_stats.downloaded_bytes
        loader.close()
        warm, loader = tokens_per_second(uri, cache_dir=cache)
        hits = loader.cache_stats.downloads
        loader.close()
        shards = read_manifest(uri).formats["megatron"].shards
        print(f"loader, windows T={SEQ} B={BATCH}, one epoch, "
              f"{sum(s.tokens for s in shards):,} tokens in {len(shards)} shards "
              f"({size / 1e6:.0f} MB)")
        print_table([("contender", "M tokens/s", "x local"),
                     ("local memmap", f"{base / 1e6:.1f}", "1.00"),
                     ("s3, cold cache", f"{cold / 1e6:.1f}", f"{cold / base:.2f}"),
                     ("s3, warm cache", f"{warm / 1e6:.1f}", f"{warm / base:.2f}")])
        print(f"cold run downloaded {downloaded / 1e6:.0f} MB; warm run downloaded {hits} "
              "files")

        small = synthetic_token_dataset(workdir, args.epoch_tokens, seed=1,
                                        shard_tokens=500_000)
        small_uri = f"s3://{args.bucket}/epoch-{args.epoch_tokens}"
        small_size = upload(small, small_uri)
        budget = small_size // 4
        rows = [("shuffle", "downloaded MB", "x dataset")]
        for shuffle in ("global", "shard_local"):
            fetched = bytes_per_epoch(small_uri, workdir / f"cache-{shuffle}", budget, shuffle)
            rows.append((shuffle, f"{fetched / 1e6:.0f}", f"{fetched / small_size:.2f}"))
        tokens = sum(s.tokens for s in read_manifest(small_uri).formats["megatron"].shards)
        print(f"\nbytes downloaded by one node in one epoch, {tokens:,} tokens "
              f"({small_size / 1e6:.0f} MB), cache budget {budget / 1e6:.0f} MB (1/4)")
        print_table(rows)
    finally:
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    main()
