"""Ingest benchmark: the tokenize job on corpora shaped as users' are (many small files of
long-tailed sizes, one large file, a giant row), locally and on an S3-protocol server made
as slow as a bucket, against the same rows in a few files, measured in the same run.

    python bench/ingest_bench.py [--files 1000,10000] [--big-mb 100] [--units 2000]
                                 [--s3-files 2000] [--latency-ms 20] [--giant-mb 150]
                                 [--workdir bench_out/ingest]

Every job runs as `ray job submit` runs one: a fresh driver process against a running
cluster (`ray start --head`, 2 CPUs, loopback), Megatron output, the shipped 8k tokenizer.
Texts are the machine's docstrings, drawn with repetition (the bench measures what the job
pays around the encoder, not the encoder). It prints, per case: wall time, the driver's CPU
(its own rusage: planning, Ray Data's executor, records, progress, the manifest), units and
shards, and core time per unit outside the units' own CPU (every process of the cluster
and the driver, sampled from /proc, less the unit records' cpu_seconds):

1. N small files (sizes lognormal, median 8 KB) plus one --big-mb file, against the same
   rows in 8 files plus the same big file: the wall ratio (target <= 2x) and the unit count
   against (total bytes / unit_bytes + large files);
2. --units units of one small file each (unit_bytes below every file), and one such unit
   alone (the job's fixed cost): the driver's CPU per unit past the first (target <= 1 ms)
   and the core time per unit outside the units' own CPU past the first (target <= 5 ms);
3. --s3-files small files on moto's S3 server behind a loopback proxy adding --latency-ms to
   every request (bench/latency_proxy.py): planning time (target <= 20 s), the first run,
   and a rerun of the finished output (target <= 20 s), with requests per input file and
   per committed unit;
4. one --giant-mb row among ordinary ones: counted as too_long and named in the rejects,
   the driver's and every unit's peak RSS (target < 3 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from common import print_table
from latency_proxy import LatencyProxy
from object_storage_bench import start_moto
from tokenize_bench import Cluster, TreeCPU

from raypipe.demo.corpus import gather_docstrings

TOKENIZER = Path(__file__).resolve().parents[1] / "raypipe" / "demo" / "tokenizer.json"
UNIT_BYTES = 64 << 20
JOB = r"""
import json, resource, sys, time
from raypipe.config import load_config
from raypipe.io.manifest import read_manifest, unit_record_name
from raypipe.io.records import UnitRecord
from raypipe.io.store import Store
from raypipe.ray.executor import run_on_ray as run_tokenize
from raypipe.ray.session import leave_ray

inputs, output, tokenizer, unit_bytes, address, extra = sys.argv[1:7]
config = load_config(None, inputs=json.loads(inputs), output=output, tokenizer=tokenizer,
                     formats=["megatron"], unit_bytes=int(unit_bytes), address=address,
                     **json.loads(extra))
summary = run_tokenize(config)
usage = resource.getrusage(resource.RUSAGE_SELF)
driver_cpu = usage.ru_utime + usage.ru_stime
store = Store(output)
records = [UnitRecord.from_json(store.read_json(unit_record_name(u.name)), "")
           for u in read_manifest(store).units]
print(json.dumps({"units": summary.units, "units_run": summary.units_run,
                  "shards": summary.shards, "skipped": summary.skipped,
                  "driver_cpu": driver_cpu, "driver_rss": usage.ru_maxrss * 1024,
                  "unit_cpu": sum(r.cpu_seconds for r in records),
                  "unit_rss": max((r.peak_rss_bytes for r in records), default=0),
                  "rejects": sum(len(r.rejects) for r in records)}), flush=True)
leave_ray()  # as `raypipe tokenize` does once its summary is printed
"""


def texts_pool(chars: int = 4_000_000) -> list[str]:
    return [text for text in gather_docstrings(limit_chars=chars) if len(text) > 40]


def write_rows(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(texts, pa.large_string())}), path,
                   row_group_size=4096)


def small_files(directory: Path, pool: list[str], files: int, seed: int = 0
                ) -> list[list[str]]:
    """`files` parquet files of lognormal sizes (median 8 KB); their rows, per file."""
    rng = random.Random(seed)
    rows_per_file = []
    for index in range(files):
        target = min(max(int(rng.lognormvariate(9.0, 1.0)), 1000), 2 << 20)
        rows, size = [], 0
        while size < target:
            rows.append(pool[rng.randrange(len(pool))])
            size += len(rows[-1])
        write_rows(directory / f"part-{index:07d}.parquet", rows)
        rows_per_file.append(rows)
    return rows_per_file


def big_file(path: Path, pool: list[str], megabytes: int) -> Path:
    rng = random.Random(1)
    rows, size = [], 0
    while size < megabytes << 20:
        rows.append(pool[rng.randrange(len(pool))])
        size += len(rows[-1])
    write_rows(path, rows)
    return path


def run_job(cluster: Cluster, inputs: list[str], output: str, unit_bytes: int = UNIT_BYTES,
            **options) -> dict:
    """One tokenize job in a fresh driver process against `cluster`, with its figures."""
    if "://" not in output:
        shutil.rmtree(output, ignore_errors=True)
    began = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", JOB, json.dumps(inputs), output,
                                str(TOKENIZER), str(unit_bytes), cluster.address,
                                json.dumps(options)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=cluster.env)
    cpu = TreeCPU([process.pid, cluster.process.pid])
    stdout, stderr = process.communicate()
    core = cpu.stop()
    if process.returncode:
        raise RuntimeError(f"the job failed ({process.returncode}): {stderr[-3000:]}")
    return {**json.loads(stdout.strip().splitlines()[-1]), "wall": time.perf_counter() - began,
            "core": core}


def outside_ms(job: dict) -> float:
    """Core time per unit run outside the units' own CPU, in ms."""
    return 1000 * (job["core"] - job["unit_cpu"]) / max(job["units_run"], 1)


def files_case(cluster: Cluster, workdir: Path, pool: list[str], files: int,
               big_mb: int) -> list[tuple[str, ...]]:
    """Many small files and a big one, against the same rows in 8 files and the big one."""
    base = workdir / f"files-{files}"
    if not (base / "done").exists():
        shutil.rmtree(base, ignore_errors=True)
        rows = small_files(base / "many", pool, files)
        flat = [text for part in rows for text in part]
        for index in range(8):
            write_rows(base / "few" / f"part-{index}.parquet", flat[index::8])
        big_file(base / "big.parquet", pool, big_mb)
        (base / "done").touch()
    big = str(base / "big.parquet")
    total = sum(p.stat().st_size for p in (base / "many").glob("*.parquet")) + \
        (base / "big.parquet").stat().st_size
    few = run_job(cluster, [str(base / "few"), big], str(base / "out-few"))
    many = run_job(cluster, [str(base / "many"), big], str(base / "out-many"))
    bound = total / UNIT_BYTES + 1
    return [
        (f"{files:,} files + {big_mb} MB", f"{many['wall']:.1f}",
         f"{many['wall'] / few['wall']:.2f}x (<= 2x)", f"{many['driver_cpu']:.2f}",
         f"{many['units']} (bound {bound:.1f})", str(many["shards"]),
         f"{outside_ms(many):.0f}"),
        ("  same rows in 8 files", f"{few['wall']:.1f}", "1.00x", f"{few['driver_cpu']:.2f}",
         str(few["units"]), str(few["shards"]), f"{outside_ms(few):.0f}"),
    ]


def units_case(cluster: Cluster, workdir: Path, pool: list[str], units: int
               ) -> list[tuple[str, ...]]:
    """`units` units of one small file each: the driver's CPU and the overhead per unit."""
    base = workdir / f"units-{units}"
    if not (base / "done").exists():
        shutil.rmtree(base, ignore_errors=True)
        long_texts = [text for text in pool if len(text) > 1500][:5000]
        small_files(base / "in", long_texts or pool, units)
        (base / "done").touch()
    first = sorted((base / "in").glob("*.parquet"))[0]
    one = run_job(cluster, [str(first)], str(base / "out-one"), unit_bytes=1000)
    job = run_job(cluster, [str(base / "in")], str(base / "out"), unit_bytes=1000)
    extra = job["units"] - one["units"]
    driver_ms = 1000 * (job["driver_cpu"] - one["driver_cpu"]) / extra
    outside = 1000 * ((job["core"] - job["unit_cpu"]) - (one["core"] - one["unit_cpu"])) / extra
    return [(f"{job['units']:,} units of one file", f"{job['wall']:.1f}", "",
             f"{job['driver_cpu']:.2f} ({driver_ms:.2f} ms a unit past the first; <= 1 ms)",
             str(job["units"]), str(job["shards"]), f"{outside:.1f} past the first (<= 5 ms)"),
            ("  one unit (the fixed cost)", f"{one['wall']:.1f}", "",
             f"{one['driver_cpu']:.2f}", "1", str(one["shards"]), f"{outside_ms(one):.0f}")]


class SlowBucket:
    """moto's S3 server behind a loopback proxy adding `latency_ms` to every request; the
    environment points at the proxy, so a cluster started after it reaches the bucket
    through the proxy too."""

    def __init__(self, latency_ms: float):
        os.environ.pop("AWS_ENDPOINT_URL", None)  # this bench's own server, always
        self.moto = start_moto()
        self.direct_url = os.environ["AWS_ENDPOINT_URL"]  # the bench's uploads skip the proxy
        port = int(self.direct_url.rsplit(":", 1)[1])
        self.proxy = LatencyProxy(port, latency_ms).start()
        os.environ["AWS_ENDPOINT_URL"] = self.proxy.url

    def stop(self) -> None:
        self.proxy.stop()
        if self.moto is not None:
            self.moto.terminate()


def s3_case(cluster: Cluster, bucket: SlowBucket, workdir: Path, pool: list[str], files: int,
            latency_ms: float) -> list[tuple[str, ...]]:
    """Small files on the S3-protocol server behind the latency proxy: planning, the first
    run and a rerun, with requests counted."""
    import boto3

    from raypipe.io.store import Store
    from raypipe.preprocess.inputs import find_inputs
    from raypipe.preprocess.planning import plan_inputs

    local = workdir / f"s3-{files}"
    if not (local / "done").exists():
        shutil.rmtree(local, ignore_errors=True)
        small_files(local / "in", pool, files, seed=2)
        (local / "done").touch()
    client = boto3.client("s3", endpoint_url=bucket.direct_url)
    client.create_bucket(Bucket="ingest")
    for path in sorted((local / "in").glob("*.parquet")):
        client.upload_file(str(path), "ingest", f"in/{path.name}")
    proxy = bucket.proxy
    began, before = time.perf_counter(), proxy.total
    found = find_inputs(["s3://ingest/in"])
    plan = plan_inputs(found, ["text"], UNIT_BYTES)
    planning, plan_requests = time.perf_counter() - began, proxy.total - before
    before = proxy.total
    first = run_job(cluster, ["s3://ingest/in"], "s3://ingest/out")
    first_requests = proxy.total - before
    before = proxy.total
    rerun = run_job(cluster, ["s3://ingest/in"], "s3://ingest/out")
    rerun_requests = proxy.total - before
    assert Store("s3://ingest/out").exists("manifest.json") and rerun["units_run"] == 0
    return [
        (f"S3 +{latency_ms:.0f} ms: plan {files:,} files", f"{planning:.1f} (<= 20 s)", "",
         "", str(len(plan.units)), "", f"{plan_requests / files:.2f} requests a file"),
        ("  first run", f"{first['wall']:.1f}", "", f"{first['driver_cpu']:.2f}",
         str(first["units"]), str(first["shards"]), f"{first_requests / files:.2f} "
         "requests a file"),
        ("  rerun of the finished output", f"{rerun['wall']:.1f} (<= 20 s)", "",
         f"{rerun['driver_cpu']:.2f}", str(rerun["units"]), "",
         f"{rerun_requests / max(rerun['units'], 1):.1f} requests a committed unit"),
    ]


def giant_case(cluster: Cluster, workdir: Path, pool: list[str], giant_mb: int
               ) -> list[tuple[str, ...]]:
    """One row of `giant_mb` MB among ordinary ones."""
    path = workdir / f"giant-{giant_mb}" / "in.parquet"
    if not path.exists():
        write_rows(path, [*pool[:2000], "word " * ((giant_mb << 20) // 5), *pool[2000:4000]])
    chars = (giant_mb << 20) // 5 * 5
    limit = {} if chars > 10_000_000 else {"max_document_chars": chars // 2}  # tiny runs
    job = run_job(cluster, [str(path)], str(path.parent / "out"), **limit)
    return [(f"one {giant_mb} MB row", f"{job['wall']:.1f}", "",
             f"{job['driver_cpu']:.2f}", str(job["units"]), str(job["shards"]),
             f"skipped {job['skipped']}, {job['rejects']} named; peak RSS driver "
             f"{job['driver_rss'] / 2**20:.0f} MiB, unit {job['unit_rss'] / 2**20:.0f} MiB "
             "(< 3 GB)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="1000,10000", help="comma list of file counts")
    parser.add_argument("--big-mb", type=int, default=100)
    parser.add_argument("--units", type=int, default=2000)
    parser.add_argument("--s3-files", type=int, default=2000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--giant-mb", type=int, default=150)
    parser.add_argument("--pool-chars", type=int, default=4_000_000,
                        help="characters of docstrings the texts are drawn from")
    parser.add_argument("--workdir", default="bench_out/ingest")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    pool = texts_pool(args.pool_chars)
    rows = [("case", "wall s", "vs 8 files", "driver CPU s", "units", "shards",
             "outside units, ms a unit")]
    bucket = SlowBucket(args.latency_ms) if args.s3_files else None
    cluster = Cluster(workdir)  # one cluster for every case; it reaches the bucket's proxy
    try:
        for files in [int(n) for n in args.files.split(",") if n]:
            rows += files_case(cluster, workdir, pool, files, args.big_mb)
        if args.units:
            rows += units_case(cluster, workdir, pool, args.units)
        if args.giant_mb:
            rows += giant_case(cluster, workdir, pool, args.giant_mb)
        if bucket is not None:
            rows += s3_case(cluster, bucket, workdir, pool, args.s3_files, args.latency_ms)
    finally:
        cluster.stop()
        if bucket is not None:
            bucket.stop()
    print_table(rows)


if __name__ == "__main__":
    main()
