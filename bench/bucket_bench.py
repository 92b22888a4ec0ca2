"""Bucket bench: training straight from a bucket through a node cache of 10% of the data,
under the windowed shuffle that `shuffle="auto"` picks on object storage, behind a proxy that
adds latency and faults to every request.

    python bench/bucket_bench.py [--tokens 64_000_000] [--shard-tokens 1_000_000]

It starts a moto S3 server on 127.0.0.1 and, in front of it, bench/latency_proxy.py: 50 ms a
request, 5% of the GETs answered `503 SlowDown`, 1% reset. One epoch, bestfit, T=2048, each
rank a process of its own with a consumer step of 5 ms, and prints:
- one node of 2 ranks sharing one cache: bytes fetched / dataset, GETs per object (counted
  by the proxy), retries, the training thread's wait per step (p50, p99, max after the first
  batch) and the first batch; whether every batch equals the same run over a local copy;
- a resume at 3 ranks on a fresh node (empty cache) from a state at step 20: its batches
  against the local copy resumed from the same state;
- two nodes of 2 ranks, each with its own cache: bytes fetched over both nodes;
- the shuffle's quality: the global shuffle, the windowed one, and MosaicML streaming's
  `py1e` (its own function) at the same budget;
- a projection to 1,000 ranks on 125 nodes over 4 TB.
Targets (issue 53): bytes <= 1.2x the dataset, GETs <= 1.2x the objects, p99 wait <= 50 ms,
max <= 500 ms, first batch <= 5 s, batches identical to the local copy's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
from common import print_table, synthetic_token_dataset
from latency_proxy import LatencyProxy
from object_storage_bench import start_moto, upload

from raypipe.io.manifest import read_manifest
from raypipe.loader import TokenLoader
from raypipe.sampling.permute import FeistelPermutation, WindowedPermutation
from raypipe.sampling.plans import LaneOrder, lane_bounds, window_blocks_for

SEQ, BATCH, SEED, STEP_S, RESUME_AT = 2048, 4, 7, 0.005, 20


def digest(batch) -> str:
    data = batch.inputs.numpy().tobytes() + batch.targets.numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def rank_main(order: dict) -> None:
    """One rank in a process of its own: its batches' digests by step, its waits and cache
    counts, and (asked for) the state after step `save_at`, as JSON on stdout."""
    loader = TokenLoader(order["path"], SEQ, BATCH, rank=order["rank"],
                         world_size=order["world"], seed=SEED, cache_dir=order.get("cache"),
                         cache_bytes=order.get("budget"), **order.get("knobs", {}))
    if order.get("state"):
        loader.load_state_dict(order["state"])
    steps, state = {}, None
    for batch in loader:
        time.sleep(STEP_S)  # the consumer's step
        steps[batch.step] = digest(batch)
        if batch.step + 1 == order.get("save_at"):
            state = loader.state_dict()
    stats = loader.stats
    loader.close()
    cache = stats.cache
    print(json.dumps({"steps": steps, "state": state, "waits": stats.waits.metrics(),
                      "fetched": cache.downloaded_bytes if cache else 0,
                      "retries": cache.retries if cache else 0,
                      "knobs": loader.state_dict()["knobs"]}))


def run_ranks(orders: list[dict], endpoint: str) -> list[dict]:
    """The ranks of `orders` at once, one process each (the endpoint: the proxy); the ranks
    of one cache directory are one node (LOCAL_WORLD_SIZE, as Ray Train sets it)."""
    script = str(Path(__file__).resolve())
    per_node = {order["cache"]: sum(o["cache"] == order["cache"] for o in orders)
                for order in orders}
    processes = [subprocess.Popen(
        [sys.executable, script, "--rank", json.dumps(order)], stdout=subprocess.PIPE,
        text=True, env={**os.environ, "AWS_ENDPOINT_URL": endpoint,
                        "LOCAL_WORLD_SIZE": str(per_node[order["cache"]])})
        for order in orders]
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=1800)
        if process.returncode:
            raise RuntimeError(f"a rank failed (exit {process.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def local_steps(path: Path, world: int, knobs: dict, state: dict | None = None
                ) -> tuple[dict[tuple[int, int], str], dict | None]:
    """(rank, step) -> digest of the same run over a local copy, ranks in lockstep; the
    state after step RESUME_AT."""
    loaders = [TokenLoader(path, SEQ, BATCH, rank=rank, world_size=world, seed=SEED, **knobs)
               for rank in range(world)]
    for loader in loaders:
        if state:
            loader.load_state_dict(state)
    out, saved = {}, None
    for batches in zip(*loaders, strict=True):
        for rank, batch in enumerate(batches):
            out[(rank, batch.step)] = digest(batch)
        if batches[0].step + 1 == RESUME_AT:
            saved = loaders[0].state_dict()
    return out, saved


def served(results: list[dict]) -> dict[tuple[int, int], str]:
    return {(rank, int(step)): value for rank, result in enumerate(results)
            for step, value in result["steps"].items()}


def waits_row(name: str, results: list[dict]) -> tuple:
    worst = {key: max(result["waits"][key] for result in results)
             for key in results[0]["waits"]}
    return (name, f"{worst['data_wait_p50_ms']:.0f}", f"{worst['data_wait_p99_ms']:.0f}",
            f"{worst['data_wait_max_ms']:.0f}", f"{worst['data_wait_first_batch_s']:.2f}")


def quality(shard_documents: np.ndarray, lanes: int, step_documents: int) -> list[tuple]:
    """How global each order is: the share of document pairs of one step from one shard
    (lower is better; the global shuffle's is ~ the chance two random documents share a
    shard), and the spread of each shard's documents over the epoch (the std of their
    positions / the epoch; 0.289 is uniform). Documents in order, as mode documents serves
    them (bestfit's rows draw from the same blocks)."""
    from raypipe.loader.mosaic_streaming import import_streaming

    import_streaming()
    from streaming.base.shuffle.py1e import get_shuffle_py1e

    total = int(shard_documents.sum())
    shard_of = np.repeat(np.arange(shard_documents.size), shard_documents)
    every = np.arange(total, dtype=np.int64)
    window = window_blocks_for(shard_documents.size, 0, lanes)
    windowed = WindowedPermutation(shard_documents, window, SEED)
    lane_order = LaneOrder(lane_bounds(windowed.window_starts, lanes, lambda starts: starts))
    held = int(total * 2 * window * lanes / shard_documents.size)  # what a node holds
    orders = {
        "global (Feistel over every document)": FeistelPermutation(total, SEED)(every),
        f"windowed, {lanes} lane(s) of {window}-shard windows": windowed(lane_order(every)),
        # mosaic's py1e, one canonical node, blocks of the documents our node holds
        f"mosaic py1e (block {held:,} samples)": get_shuffle_py1e(
            shard_documents.astype(np.int64), 1, SEED, 0, held),
    }
    rows = [("order", "same-shard pairs in a step", "shard spread (0.289 uniform)")]
    for name, order in orders.items():
        shards = shard_of[order]
        steps = shards[: total // step_documents * step_documents].reshape(-1, step_documents)
        counts = np.stack([np.bincount(row, minlength=shard_documents.size) for row in steps])
        pairs = (counts * (counts - 1)).sum(axis=1) / (step_documents * (step_documents - 1))
        positions = np.empty(total, dtype=np.float64)
        positions[order] = np.arange(total) / total  # position of each document
        spread = np.mean([positions[shard_of == shard].std()
                          for shard in range(shard_documents.size) if shard_documents[shard]])
        rows.append((name, f"{pairs.mean():.4f}", f"{spread:.3f}"))
    return rows


def projection(shards: int = 10_000, dataset_tb: float = 4.0, nodes: int = 125,
               ranks: int = 1000, step_tokens: float = 4e6, step_s: float = 1.0,
               document_tokens: float = 1000) -> list[tuple]:
    """1,000 ranks on 125 nodes over 4 TB of uint16 tokens in 10^4 shards (a .bin and an
    .idx each), documents of ~1,000 tokens, steps of 4 M tokens a second; auto's windowed
    shuffle with a lane per rank: what each node fetches and holds."""
    dataset = dataset_tb * 1e12
    shard_bytes = dataset / shards
    window = window_blocks_for(shards, 0, ranks)
    lane_shards = shards / ranks
    per_rank = ranks // nodes
    epoch_s = dataset / 2 / step_tokens * step_s
    documents = dataset / 2 / document_tokens
    index_bytes = documents * (12 + 8) + 4 * documents  # Megatron .idx, the lengths file
    fetched = per_rank * lane_shards * shard_bytes  # the node's lanes (+ leftovers' tail)
    return [("figure", "value"),
            ("lanes / shards per lane / window", f"{ranks} / {lane_shards:.0f} / {window} "
             "shard(s)"),
            ("a step mixes documents of", f"{ranks * window:,} shards"),
            ("bytes per node per epoch", f"{fetched / 1e9:,.0f} GB (goal: "
             f"{dataset / nodes / 1e9:.0f} GB)"),
            ("disk per node: windows held (2 a rank)",
             f"{per_rank * 2 * window * shard_bytes / 1e9:,.1f} GB"),
            ("disk per node: every .idx + the lengths file",
             f"{index_bytes / 1e9:,.0f} GB (read once when the loader opens)"),
            ("GETs per second against the bucket",
             f"{nodes * per_rank * lane_shards * 2 / epoch_s:.2f} (epoch of "
             f"{epoch_s / 3600:.0f} h)"),
            ("fetch rate per node", f"{fetched / epoch_s / 1e6:.1f} MB/s")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=64_000_000)
    parser.add_argument("--shard-tokens", type=int, default=1_000_000)
    parser.add_argument("--delay-ms", type=float, default=50)
    parser.add_argument("--slow-down", type=float, default=0.05)
    parser.add_argument("--resets", type=float, default=0.01)
    parser.add_argument("--cache-share", type=float, default=0.10)
    parser.add_argument("--two-nodes", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--workdir", default="bench_out")
    args = parser.parse_args()
    if args.rank:
        rank_main(json.loads(args.rank))
        return
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    server = start_moto()
    try:
        bench(args, workdir)
    finally:
        if server is not None:
            server.terminate()


def chosen(share: float, salt: str):
    """A GET picked with probability `share`, by a hash of (path, try, salt): the same
    faults on every run, a retry drawn afresh."""
    def pick(path: str, asked: int) -> bool:
        value = hashlib.sha256(f"{salt}/{path}/{asked}".encode()).digest()
        return int.from_bytes(value[:4], "little") < share * 2**32
    return pick


def bench(args: argparse.Namespace, workdir: Path) -> None:
    local = synthetic_token_dataset(workdir, args.tokens, seed=3,
                                    shard_tokens=args.shard_tokens)
    uri = f"s3://raypipe-bench/bucket-{args.tokens}-{args.shard_tokens}"
    size = upload(local, uri)
    shards = read_manifest(uri).formats["megatron"].shards
    objects = sum(len(shard.files) for shard in shards)
    budget = int(size * args.cache_share)
    proxy = LatencyProxy(urlparse(os.environ["AWS_ENDPOINT_URL"]).port, args.delay_ms,
                         chosen(args.slow_down, "503"), chosen(args.resets, "reset")).start()
    knobs = {"shuffle": "windowed"}  # what auto resolves to on the bucket, for the copy
    print(f"{len(shards)} shards, {objects} objects, {size / 1e6:.1f} MB; cache "
          f"{budget / 1e6:.1f} MB ({args.cache_share:.0%}); proxy {args.delay_ms:.0f} ms a "
          f"request, {args.slow_down:.0%} 503 SlowDown, {args.resets:.0%} resets")
    try:
        reference, state = local_steps(local, 2, knobs)

        def node(ranks: range, world: int, cache: str, state: dict | None = None,
                 save_at: int | None = None) -> list[dict]:
            shutil.rmtree(workdir / cache, ignore_errors=True)
            return [{"path": uri, "rank": rank, "world": world, "cache": str(workdir / cache),
                     "budget": budget, "state": state, "save_at": save_at}
                    for rank in ranks]

        gets_before = sum(proxy.gets.values())
        assert not proxy.gets, "the proxy counts this run's GETs alone"
        began = time.perf_counter()
        one = run_ranks(node(range(2), 2, "cache-one"), proxy.url)
        seconds = time.perf_counter() - began
        gets = sum(proxy.gets.values()) - gets_before
        by_kind = {suffix: sum(count for path, count in proxy.gets.items()
                               if path.endswith(suffix)) / len(shards)
                   for suffix in (".bin", ".idx")}
        assert one[0]["knobs"].get("shuffle") == "windowed", one[0]["knobs"]
        same = served(one) == reference
        fetched = sum(result["fetched"] for result in one)
        rows = [("run", "bytes / dataset", "GETs / object", "retries", "identical to local")]
        rows.append(("1 node x 2 ranks", f"{fetched / size:.2f}", f"{gets / objects:.2f}",
                     str(sum(r["retries"] for r in one)), str(same)))
        resumed_reference, _ = local_steps(local, 3, knobs, state)
        three = run_ranks(node(range(3), 3, "cache-three", state), proxy.url)
        rows.append(("resume at 3 ranks, empty cache",
                     f"{sum(r['fetched'] for r in three) / size:.2f}", "", str(
                         sum(r["retries"] for r in three)),
                     str(served(three) == resumed_reference)))
        if args.two_nodes:
            two = run_ranks(node(range(0, 2), 4, "cache-node-a")
                            + node(range(2, 4), 4, "cache-node-b"), proxy.url)
            rows.append(("2 nodes x 2 ranks, a cache each",
                         f"{sum(r['fetched'] for r in two) / size:.2f}", "",
                         str(sum(r["retries"] for r in two)), "-"))
        print(f"\none epoch, bestfit T={SEQ}, {BATCH} rows a rank, consumer step "
              f"{STEP_S * 1000:.0f} ms; 1 node x 2 ranks took {seconds:.1f} s, GETs per "
              f".bin {by_kind['.bin']:.2f}, per .idx {by_kind['.idx']:.2f} (each .idx is "
              "read when the loader opens, for the lengths, and again when its shard opens "
              f"if the cache let it go); faults injected over all runs: {proxy.injected} x "
              f"503 SlowDown, {proxy.reset} resets (retried by the S3 client and raypipe)")
        print_table(rows)
        print("\nthe training thread's wait per step, worst rank (ms; first batch in s)")
        print_table([("run", "p50", "p99", "max", "first batch s"), waits_row("1 node x 2", one),
                     waits_row("resume at 3", three)])
    finally:
        proxy.stop()
    counts = np.array([shard.documents for shard in shards], dtype=np.int64)
    mean_tokens = sum(shard.tokens for shard in shards) / counts.sum()
    step_documents = max(2, int(2 * BATCH * (SEQ + 1) / mean_tokens))
    print(f"\nshuffle quality, {counts.sum():,} documents, a step of 2 ranks x {BATCH} rows "
          f"(~{step_documents} documents)")
    print_table(quality(counts, 2, step_documents))
    print("\nthe same at the projection's shape: 1,000 ranks (lanes) over 10^4 shards of 100 "
          "documents, a step of 8,000 documents")
    print_table(quality(np.full(10_000, 100, dtype=np.int64), 1000, 8000))
    print("\nprojection: 1,000 ranks on 125 nodes, 4 TB in 10^4 shards, a step of 4 M tokens "
          "a second")
    print_table(projection())


if __name__ == "__main__":
    main()
