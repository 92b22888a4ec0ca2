"""Retry bench: what one ranged read of a block costs when its GET fails, through raypipe's
Store (the S3 client's default retry strategy, then its own backoff) against pyarrow's
filesystem as `from_uri` makes it (the SDK's standard strategy), in the same run.

    python bench/retry_bench.py [--delay-ms 20] [--reads 30]

It starts a moto S3 server on 127.0.0.1 and bench/latency_proxy.py in front of it: every
request D ms late, and the first GET of each object answered `503 SlowDown` or its
connection reset (or neither: the baseline). Each read is 16 KiB of a 200 KB object opened
beforehand (its HEAD not timed). Prints the median and max ms of a read per fault, and the
median over the fault-free read's (target: a reset costs raypipe's Store under 3 requests'
time, where a training step may be waiting on the block).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from urllib.parse import urlparse

import pyarrow.fs as pafs
from common import print_table
from latency_proxy import LatencyProxy
from object_storage_bench import start_moto

from raypipe.io.store import Store

BUCKET, OBJECT_BYTES, READ = "raypipe-retry-bench", 200_000, (4096, 4096 + (16 << 10))
FAULTS: dict[str, tuple[Callable | None, Callable | None]] = {
    "none": (None, None),
    "503 SlowDown": (lambda path, asked: asked == 0, None),
    "reset": (None, lambda path, asked: asked == 0),
}


def timed_reads(read: Callable[[str], None], reads: int, prefix: str) -> list[float]:
    """ms of `read(key)` for each object `prefix`0 .. (each object's first GET the fault's)."""
    spent = []
    for index in range(reads):
        began = time.perf_counter()
        read(f"{prefix}{index}")
        spent.append((time.perf_counter() - began) * 1000)
    return spent


def store_reader(reads: int, prefix: str) -> Callable[[str], None]:
    store = Store(f"s3://{BUCKET}")
    for index in range(reads):
        store._ranged_handle(f"{prefix}{index}")  # the HEAD, outside the timing
    return lambda key: store.read_ranges(key, [READ])


def pyarrow_reader(reads: int, prefix: str) -> Callable[[str], None]:
    fs, _ = pafs.FileSystem.from_uri(f"s3://{BUCKET}")
    handles = {f"{prefix}{i}": fs.open_input_file(f"{BUCKET}/{prefix}{i}")
               for i in range(reads)}

    def read(key: str) -> None:
        for _ in range(6):  # what a caller without its own retries would have to do
            try:
                handles[key].read_at(READ[1] - READ[0], READ[0])
                return
            except OSError:
                continue
    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=20)
    parser.add_argument("--reads", type=int, default=30)
    args = parser.parse_args()
    server = start_moto()
    try:
        import boto3

        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        objects = [f"{reader}-{fault}-{i}" for reader in ("store", "pyarrow")
                   for fault in range(len(FAULTS)) for i in range(args.reads)]
        for key in objects:
            client.put_object(Bucket=BUCKET, Key=key, Body=os.urandom(OBJECT_BYTES))
        target = urlparse(os.environ["AWS_ENDPOINT_URL"]).port
        rows, baseline = [("reader", "fault", "median ms", "max ms", "x no fault")], {}
        for number, (fault, (fails, resets)) in enumerate(FAULTS.items()):
            for name, reader in (("raypipe Store", store_reader),
                                 ("pyarrow from_uri", pyarrow_reader)):
                proxy = LatencyProxy(target, args.delay_ms, fails, resets).start()
                os.environ["AWS_ENDPOINT_URL"] = proxy.url
                prefix = f"{'store' if reader is store_reader else 'pyarrow'}-{number}-"
                spent = timed_reads(reader(args.reads, prefix), args.reads, prefix)
                proxy.stop()
                median = statistics.median(spent)
                baseline.setdefault(name, median)
                rows.append((name, fault, f"{median:.0f}", f"{max(spent):.0f}",
                             f"{median / baseline[name]:.1f}"))
        print(f"proxy {args.delay_ms:.0f} ms a request; {args.reads} reads of 16 KiB per row; "
              "each object's first GET the fault")
        print_table(rows)
    finally:
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    sys.exit(main())
