"""Bucket bench: training straight from a bucket, over a grid of shapes, each cell through a
proxy that adds latency and faults to every request.

    python bench/bucket_bench.py [--grid quick|full] [--delay-ms 20]
        [--cell SIZE,PER_RANK,SHARE,NODES ...] [--format FORMAT] [--step-ms 5] [--mixture]
        [--chat] [--follow-advice] [--block-bytes N]

It starts a moto S3 server on 127.0.0.1 and, in front of it, bench/latency_proxy.py: 20 ms
a request, 5% of the GETs answered `503 SlowDown`, 1% reset. A cell is a dataset of
Megatron shards (or --format's; small: ~75 K tokens each, large: ~2.5 M), a number of
shards per rank (at 2 ranks), a node cache of 5, 10 or 25% of the data, and 1 node x 2
ranks or 2 nodes x 2 ranks (a cache each); --cell runs the cells named instead of a grid.
One epoch of bestfit T=2048, 4 rows a rank, each rank a process of its own with a consumer
step of 5 ms (--step-ms), the ranks in lockstep as data-parallel training keeps them (a
barrier after each step, the gradients' all-reduce; --free-running: none),
`shuffle="auto"` (windowed: blocks sized from the budget).
--mixture makes every cell a mixture of two such datasets on the bucket (weights by
tokens, the cache shared by both: each source holds its part), served for the steps of
both datasets' tokens once; --chat makes them chat data (a loss mask beside the
tokens: a sidecar, or MDS samples' column; each document's second half trained), and a
batch's mask is compared too.
Per cell it prints:
- bytes fetched an epoch / the dataset (all nodes), GETs / (blocks + index objects: each
  shard's index files, such as Megatron's .idx and .sums, on every node), HEADs / blocks
  (an object's size, asked before its first ranged GET in a process), the
  training thread's wait after the first batch (p99, max; worst rank), the fetches' p99
  (worst rank) against the milliseconds of reading a rank's read-ahead holds (the least
  rank's: raypipe.loader.stats.FetchSizing), the least cache that sizing names (as a
  share of the data, where it is more than the cell's), the harness's load (the requests a
  second while the ranks trained over what the harness serves alone, measured at the
  start: on 2 cores moto behind the proxy serves ~300 ranged GETs of 16 KiB a second, and
  the rank processes share those cores), the block_bytes rank 0's mixing advice named
  (raypipe.loader.mixing: at the measured read rate, windows that mix shards at least
  twice as well; a loop of 5 ms steps reads too fast for any), the blocks a reader
  fetched itself on the filling path, no read-ahead having asked for them ("on read", all
  ranks: 0 where every step's reads were issued ahead), and the first batch;
  --block-bytes gives the loader a block size; --follow-advice runs a cell whose
  waits miss the target again at the least cache its loader named ("advised", no resume);
- whether every batch equals the same run over a local copy given the knobs the bucket run
  resolved (block_bytes, window_blocks, lanes), and (1 node) whether a 2 -> 3 resume from an
  empty cache at step 20 equals the local copy resumed from the same state;
- the shuffle's quality on the documents' order, beside global, shard_local and MosaicML
  streaming's `get_shuffle_py1e` at the same budget: P(a rank's next document comes from
  the same shard) over uniform, distinct shards in a rank's batch and in a global step, and
  the share of shards a global order touches within 1% of the epoch.
Targets (issue 75): bytes <= 1.15x, GETs <= 1.2x the blocks, p99 wait <= 50 ms and max <=
300 ms, first batch <= 3 s + one window's fetch, batches identical, P(same shard) within 2x
of uniform at a 10% cache. Shards of 400 MB are projected (`projection`), not run.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.managers import BarrierProxy, BaseManager
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pyarrow.fs as pafs
from common import print_table, synthetic_token_dataset
from latency_proxy import LatencyProxy
from object_storage_bench import start_moto, upload

from raypipe.dataset import TokenDataset
from raypipe.formats import document_formats, get_format
from raypipe.io.manifest import read_manifest
from raypipe.loader import open_loader
from raypipe.loader.mixing import times_uniform
from raypipe.sampling.blocks import WHOLE_SHARDS, WINDOWS_HELD, WindowBudget, cut_blocks
from raypipe.sampling.lengths import DocumentLengths
from raypipe.sampling.permute import FeistelPermutation, GroupedPermutation, WindowedPermutation
from raypipe.sampling.plans import LaneOrder, lane_bounds, window_blocks_for

SEQ, BATCH, SEED, STEP_S, RESUME_AT = 2048, 4, 7, 0.005, 20
WAIT_P99_MS, WAIT_MAX_MS = 50, 300  # issue 75's targets after the first batch
SHARD_TOKENS = {"small": 75_000, "large": 2_500_000}  # ~0.15 MB and ~5 MB of uint16
GRIDS = {  # (shard size, shards per rank at 2 ranks, cache share, nodes of 2 ranks)
    "quick": [("small", 20, 0.10, 1), ("small", 200, 0.10, 1), ("small", 2, 0.10, 1),
              ("small", 20, 0.05, 1), ("small", 20, 0.25, 1), ("small", 20, 0.10, 2),
              ("large", 2, 0.10, 1)],
    "full": [(size, per_rank, share, nodes)
             for size in ("small", "large") for per_rank in (0.5, 2, 20, 200)
             for share in (0.05, 0.10, 0.25) for nodes in (1, 2)
             if not (size == "large" and per_rank == 200)],  # 2 GB: projected
}


def digest(batch) -> str:
    data = (batch.inputs.numpy().tobytes() + batch.targets.numpy().tobytes()
            + batch.mask.numpy().tobytes())
    return hashlib.sha256(data).hexdigest()[:16]


def rank_main(order: dict) -> None:
    """One rank in a process of its own: its batches' digests by step, its waits and cache
    counts, and (asked for) the state after step `save_at`, as JSON on stdout."""
    loader = open_loader(order["path"], SEQ, BATCH, rank=order["rank"],
                         world_size=order["world"], seed=SEED, cache_dir=order.get("cache"),
                         cache_bytes=order.get("budget"), format=order["format"],
                         **order.get("knobs", {}))
    if order.get("state"):
        loader.load_state_dict(order["state"])
    steps, state, trained_from = {}, None, None
    lockstep = Lockstep.joined(order.get("lockstep"))
    for batch in itertools.islice(loader, order["steps"]):  # (a mixture has no end)
        trained_from = trained_from or time.monotonic()
        time.sleep(order["step_s"])  # the consumer's step
        lockstep.step()
        steps[batch.step] = digest(batch)
        if batch.step + 1 == order.get("save_at"):
            state = loader.state_dict()
    trained = (trained_from or time.monotonic(), time.monotonic())
    stats = loader.stats
    on_read = sum(dataset.blocks_fetched_on_read for dataset in loader._datasets())
    loader.close()
    cache = stats.cache
    print(json.dumps({"steps": steps, "state": state, "waits": stats.waits.metrics(),
                      "fetched": cache.downloaded_bytes if cache else 0,
                      "retries": cache.retries if cache else 0, "on_read": on_read,
                      "sizing": stats.sizing.metrics() if stats.sizing else {},
                      "trained": trained,
                      "advised_block_bytes": stats.metrics().get("advised_block_bytes", 0),
                      "knobs": loader.state_dict()["knobs"]}))


class Lockstep:
    """The ranks' steps kept together as data-parallel training keeps them (a gradient's
    all-reduce a step): every rank process waits at a barrier after each step until all
    have reached it. The barrier lives in a manager process the bench starts."""

    TIMEOUT_S = 120  # a rank that failed breaks the others' barrier this late

    def __init__(self, barrier=None) -> None:
        self.barrier = barrier

    @classmethod
    def serve(cls, parties: int) -> tuple[BaseManager, dict]:
        """A started manager holding one barrier of `parties`, and what a rank joins it by."""
        barrier = threading.Barrier(parties)
        manager = _StepBarrier(address=("127.0.0.1", 0), authkey=LOCKSTEP_KEY)
        _StepBarrier.register("barrier", callable=lambda: barrier, proxytype=BarrierProxy)
        manager.start()
        return manager, {"address": list(manager.address)}

    @classmethod
    def joined(cls, served: dict | None) -> Lockstep:
        """The barrier `serve` described (None: free-running ranks, no barrier)."""
        if not served:
            return cls()
        manager = _StepBarrier(address=tuple(served["address"]), authkey=LOCKSTEP_KEY)
        manager.connect()
        return cls(manager.barrier())

    def step(self) -> None:
        """Wait for every rank to end this step (a rank that ends its epoch early breaks
        the barrier: the rest run free)."""
        if self.barrier is None:
            return
        try:
            self.barrier.wait(self.TIMEOUT_S)
        except threading.BrokenBarrierError:
            print("lockstep: the barrier broke (a rank ended or failed); the rest run free",
                  file=sys.stderr)
            self.barrier = None


class _StepBarrier(BaseManager):
    """The manager that serves Lockstep's barrier."""


_StepBarrier.register("barrier", proxytype=BarrierProxy)
LOCKSTEP_KEY = b"raypipe-bucket-bench"


def run_ranks(orders: list[dict], endpoint: str, lockstep: bool = True) -> list[dict]:
    """The ranks of `orders` at once, one process each (the endpoint: the proxy); the ranks
    of one cache directory are one node (LOCAL_WORLD_SIZE, as Ray Train sets it); in
    `lockstep` (data-parallel training) unless told to run free."""
    script = str(Path(__file__).resolve())
    manager = None
    if lockstep:
        manager, served_barrier = Lockstep.serve(len(orders))
        orders = [{**order, "lockstep": served_barrier} for order in orders]
    per_node = {order["cache"]: sum(o["cache"] == order["cache"] for o in orders)
                for order in orders}
    processes = [subprocess.Popen(
        [sys.executable, script, "--rank", json.dumps(order)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**os.environ, "AWS_ENDPOINT_URL": endpoint,
             "LOCAL_WORLD_SIZE": str(per_node[order["cache"]])})
        for order in orders]
    results, failed = [], None
    try:
        for process in processes:
            out, err = process.communicate(timeout=1800)
            if process.returncode:
                failed = failed or (err.strip().splitlines() or ["?"])[-1]
                continue
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        if manager is not None:
            manager.shutdown()
    if failed:
        raise RankFailed(failed)
    return results


class RankFailed(RuntimeError):
    """A rank's process failed: its last line (a refusal names the least budget)."""


def local_steps(path: Path | dict[str, Path], world: int, knobs: dict, steps: int | None,
                state: dict | None = None
                ) -> tuple[dict[tuple[int, int], str], dict | None]:
    """(rank, step) -> digest of the same run over a local copy (a mixture: of each
    source), ranks in lockstep, `steps` of them (None: the epoch); the state after step
    RESUME_AT."""
    loaders = [open_loader(path, SEQ, BATCH, rank=rank, world_size=world, seed=SEED, **knobs)
               for rank in range(world)]
    for loader in loaders:
        if state:
            loader.load_state_dict(state)
    out, saved = {}, None
    for batches in itertools.islice(zip(*loaders, strict=True), steps):
        for rank, batch in enumerate(batches):
            out[(rank, batch.step)] = digest(batch)
        if batches[0].step + 1 == RESUME_AT:
            saved = loaders[0].state_dict()
    return out, saved


def served(results: list[dict]) -> dict[tuple[int, int], str]:
    return {(rank, int(step)): value for rank, result in enumerate(results)
            for step, value in result["steps"].items()}


def rank_streams(order: np.ndarray, ranks: int) -> list[np.ndarray]:
    """The documents each rank reads, in order: positions r, r + W, ... of `order`."""
    return [order[rank::ranks] for rank in range(ranks)]


def quality_row(name: str, order: np.ndarray, shard_of: np.ndarray, ranks: int,
                per_rank_step: int, uniform: float) -> tuple[str, ...]:
    """P(a rank's next document is from the same shard) over uniform, mean distinct shards
    in a rank's batch and in a global step, share of shards touched in 1% of the epoch."""
    shards = shard_of[order]
    same = np.mean([np.mean(stream[1:] == stream[:-1])
                    for stream in rank_streams(shards, ranks) if stream.size > 1])
    step = per_rank_step * ranks
    steps = shards[: shards.size // step * step].reshape(-1, step)
    in_step = np.mean([np.unique(row).size for row in steps]) if steps.size else 0.0
    in_batch = np.mean([np.unique(row[rank::ranks]).size for row in steps
                        for rank in range(ranks)]) if steps.size else 0.0
    early = np.unique(shards[: max(1, shards.size // 100)]).size / max(1, shard_of.max() + 1)
    return (name, f"{same:.3f} ({same / uniform:.1f}x)", f"{in_batch:.1f}", f"{in_step:.1f}",
            f"{early:.2f}")


def quality(lengths: np.ndarray, counts: np.ndarray, knobs: dict, ranks: int,
            budget: int, index_bytes: int, itemsize: int) -> list[tuple[str, ...]]:
    """The shuffle's quality on the documents' order (bestfit's rows draw from the same
    blocks in the same order), ours beside the others at the same budget (`itemsize`: the
    bytes a token counts for in a block)."""
    from raypipe.loader.mosaic_streaming import import_streaming

    import_streaming()
    from streaming.base.shuffle.py1e import get_shuffle_py1e

    total = int(counts.sum())
    shard_of = np.repeat(np.arange(counts.size), counts)
    uniform = float(((counts / total) ** 2).sum())
    every = np.arange(total, dtype=np.int64)
    mean_tokens = lengths.mean()
    per_rank_step = max(1, int(BATCH * (SEQ + 1) / mean_tokens))
    doc_lengths = DocumentLengths(counts, lambda s: lengths[counts[:s].sum():
                                                            counts[:s + 1].sum()])
    blocks = cut_blocks(doc_lengths, counts, itemsize, int(knobs["block_bytes"]))
    window_bytes = WindowBudget(budget, ranks, index_bytes).window_bytes
    held_docs = max(1, int(window_bytes * WINDOWS_HELD * ranks / (itemsize * mean_tokens)))
    shard_bytes = counts.mean() * mean_tokens * itemsize
    group = max(1, int(window_bytes / shard_bytes))
    orders = {
        "global": FeistelPermutation(total, SEED)(every),
        f"shard_local ({group} shard(s) a group)": GroupedPermutation(
            np.add.reduceat(counts, np.arange(0, counts.size, group)), SEED)(every),
        f"py1e (block {held_docs:,} samples)": get_shuffle_py1e(
            counts.astype(np.int64), 1, SEED, 0, held_docs),
    }
    if knobs["shuffle"] == "windowed":
        lanes = int(knobs.get("lanes", ranks))
        windowed = WindowedPermutation(blocks.documents, window_blocks_for(
            len(blocks), int(knobs["window_blocks"]), lanes), SEED)
        lane_order = LaneOrder(lane_bounds(windowed.window_starts, lanes, lambda starts: starts),
                               ranks_per_lane=int(knobs.get("lane_ranks", 1)))
        orders[f"raypipe windowed ({len(blocks):,} blocks)"] = windowed(lane_order(every))
    return [quality_row(name, order, shard_of, ranks, per_rank_step, uniform)
            for name, order in orders.items()]


def projected_budget(shard_mb: float, shards: int, nodes: int, ranks: int, share: float,
                     document_tokens: float = 1000
                     ) -> tuple[float, float, float, WindowBudget]:
    """(dataset bytes, a node's share of the cache, its index bytes, its WindowBudget) of
    the projected corpus: every node reads at the open and keeps each .idx's lengths (4
    bytes a document; the whole .idx is 20) and each .sums (4 bytes a 4 KiB unit)."""
    dataset = shards * shard_mb * 1e6
    budget = dataset / nodes * share
    index = dataset / 2 / document_tokens * 4 + dataset / 4096 * 4
    return dataset, budget, index, WindowBudget(
        int(budget + index), ranks // nodes, int(index), dataset_bytes=int(dataset),
        largest_shard_bytes=int(shard_mb * 1e6), shards=shards)


def projection(shard_mb: float = 400, shards: int = 10_000, nodes: int = 125,
               ranks: int = 1000, share: float = 0.10, step_tokens: float = 4e6,
               document_tokens: float = 1000) -> list[tuple[str, str]]:
    """10^4 shards of 400 MB (4 TB of uint16) on 125 nodes of 8 ranks with a node cache of
    `share` of the data a node trains: the blocks and windows raypipe picks, and what a
    node fetches and holds."""
    dataset, budget, index, fit = projected_budget(shard_mb, shards, nodes, ranks, share,
                                                   document_tokens)
    per_node = ranks // nodes
    block = fit.block_bytes(0)
    window = fit.window_blocks(block)
    shared = fit.for_lanes(per_node)  # lane_ranks = the node's ranks
    shared_block = shared.block_bytes(0)
    return [("figure", "value"),
            ("node cache (its share + every shard's lengths and .sums)",
             f"{(budget + index) / 1e9:,.0f} GB"),
            ("block / window", f"{block / 1e6:.1f} MB / {window:,} blocks"),
            ("blocks in the corpus", f"{dataset / block:,.0f}"),
            ("a rank's window draws from", f"{window:,} blocks of the whole corpus "
             f"(a shard holds {shard_mb * 1e6 / block:,.0f})"),
            ("a step mixes documents of", f"{ranks * window:,} blocks"),
            (f"... lane_ranks={per_node}: a node's window (its ranks' lane)",
             f"{shared.window_blocks(shared_block):,} blocks of "
             f"{shared_block / 1e6:.1f} MB"),
            ("bytes per node per epoch", f"{dataset / nodes / 1e9:,.0f} GB"),
            ("GETs per node per epoch", f"{dataset / nodes / block:,.0f}"),
            ("index objects a node reads at the open (.idx lengths, .sums)",
             f"{2 * shards:,}"),
            ("... all nodes at the start: GETs, bytes",
             f"{2 * shards * nodes:,}, {index * nodes / 1e12:,.1f} TB"),
            ("epoch at 4 M tokens a step, 1 step/s", f"{dataset / 2 / step_tokens / 3600:,.0f}"
             " h")]


def block_tradeoffs(shard_mb: float = 400, shards: int = 10_000, nodes: int = 125,
                    ranks: int = 1000, share: float = 0.10, step_tokens: float = 4e6,
                    step_s: float = 1.0) -> list[tuple[str, ...]]:
    """The projection's corpus under a given `block_bytes`: the automatic size against
    smaller ones. A window of W blocks drawn from S shards makes a rank's next document
    come from its shard with P ~ 1/W + 1/S, S/W + 1 times a uniform order's; a rank reads
    step_tokens x 2 / ranks bytes a step, so a block of b bytes is a GET every b / that
    bytes' worth of steps; the plan holds 16 bytes a block (its first document, its shard)
    on every node."""
    dataset, _, _, fit = projected_budget(shard_mb, shards, nodes, ranks, share)
    rank_bytes_s = step_tokens * 2 / ranks / step_s
    rows = [("block_bytes", "window", "P / uniform (~)", "GETs a rank a second",
             "GETs an epoch (all nodes)", "block arrays a node")]
    for asked in (0, 1 << 20, 256 << 10, 64 << 10):
        block = fit.block_bytes(asked)
        window = fit.window_blocks(block)
        rows.append((f"{block / 1e6:.2f} MB" + (" (auto)" if not asked else ""),
                     f"{window:,} blocks", f"{times_uniform(shards, window):,.0f}x",
                     f"{rank_bytes_s / block:.3f}", f"{dataset / block / 1e6:,.1f} M",
                     f"{dataset / block * 16 / 1e6:,.0f} MB"))
    return rows


def chosen(share: float, salt: str):
    """A GET picked with probability `share`, by a hash of (path, try, salt): the same
    faults on every run, a retry drawn afresh."""
    def pick(path: str, asked: int) -> bool:
        value = hashlib.sha256(f"{salt}/{path}/{asked}".encode()).digest()
        return int.from_bytes(value[:4], "little") < share * 2**32
    return pick


def serving_capacity(delay_ms: float, block: int = 16 << 10, threads: int = 32,
                     seconds: float = 3.0) -> float:
    """Ranged GETs of `block` bytes a second that this machine's harness (moto behind a
    proxy of `delay_ms`, no faults) serves to `threads` readers at once, the most a cell's
    ranks can be served together (on 2 cores: ~320 of 16 KiB at 20 ms)."""
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="raypipe-capacity")
    client.put_object(Bucket="raypipe-capacity", Key="object", Body=os.urandom(4 << 20))
    proxy = LatencyProxy(urlparse(os.environ["AWS_ENDPOINT_URL"]).port, delay_ms).start()
    fs = pafs.S3FileSystem(endpoint_override=proxy.url, scheme="http",
                           access_key=os.environ["AWS_ACCESS_KEY_ID"],
                           secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                           region=os.environ["AWS_DEFAULT_REGION"])
    handle = fs.open_input_file("raypipe-capacity/object")
    ends = time.monotonic() + seconds

    def reader(seed: int) -> int:
        offsets, served = np.random.default_rng(seed), 0
        while time.monotonic() < ends:
            handle.read_at(block, int(offsets.integers(0, (4 << 20) - block)))
            served += 1
        return served

    try:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(reader, range(threads))) / seconds
    finally:
        proxy.stop()


def cell(args: argparse.Namespace, workdir: Path, size: str, per_rank: float, share: float,
         nodes: int, resume: bool = True) -> tuple[list[str], list[tuple[str, ...]], float]:
    """One cell of the grid: its row of figures, its shuffle-quality rows (of the first
    dataset, a mixture's too), and the least cache share the loader's sizing named where
    its waits missed the target (0: none); `resume`: also a 2 -> 3 resume (1 node)."""
    fmt = args.format
    locals_ = {name: synthetic_token_dataset(workdir, int(per_rank * 2 * SHARD_TOKENS[size]),
                                             seed, SHARD_TOKENS[size], fmt, args.chat)
               for name, seed in (("a", 3), ("b", 4))[:2 if args.mixture else 1]}
    uris = {name: f"s3://raypipe-bench/{local.name}" for name, local in locals_.items()}
    dataset = sum(upload(locals_[name], uri) for name, uri in uris.items())
    local, uri = locals_["a"], uris["a"]
    shards = read_manifest(uri).formats[fmt].shards
    budget = int(dataset * share)
    ranks = 2 * nodes
    # a mixture: the steps of both datasets' tokens once (weights by tokens)
    steps = (sum(TokenDataset(path, fmt).num_tokens for path in locals_.values())
             // (SEQ * BATCH * ranks) if args.mixture else None)
    served_path, local_path = ((uris, locals_) if args.mixture else (uri, local))
    proxy = LatencyProxy(urlparse(os.environ["AWS_ENDPOINT_URL"]).port, args.delay_ms,
                         chosen(args.slow_down, "503"), chosen(args.resets, "reset")).start()

    def node(node_ranks: range, world: int, cache: str, state: dict | None = None,
             save_at: int | None = None) -> list[dict]:
        shutil.rmtree(workdir / cache, ignore_errors=True)
        return [{"path": served_path, "rank": rank, "world": world,
                 "cache": str(workdir / cache), "budget": budget, "state": state,
                 "save_at": save_at, "format": fmt, "step_s": args.step_ms / 1000,
                 "steps": steps,
                 # a resume takes the state's lane_ranks (it may not divide the new world)
                 "knobs": {**({"lane_ranks": args.lane_ranks}
                              if args.lane_ranks and state is None else {}),
                           **({"block_bytes": args.block_bytes} if args.block_bytes else {})}}
                for rank in node_ranks]

    try:
        orders = [order for index in range(nodes)
                  for order in node(range(2 * index, 2 * index + 2), ranks, f"cache-{index}",
                                    save_at=RESUME_AT)]
        run = run_ranks(orders, proxy.url, not args.free_running)
        gets, heads = sum(proxy.gets.values()), proxy.requests["HEAD"]
        knobs = resolved_layout(run[0]["knobs"])
        reference, _ = local_steps(local_path, ranks, {"format": fmt, **knobs}, steps)
        same = served(run) == reference
        resumed = "-"
        state = run[0]["state"]
        if resume and nodes == 1 and state is not None:
            expected, _ = local_steps(local_path, 3, {"format": fmt, **knobs}, steps, state)
            three = run_ranks(node(range(3), 3, "cache-three", state), proxy.url,
                              not args.free_running)
            resumed = str(served(three) == expected)
    finally:
        proxy.stop()
    blocks, index_objects = zip(*(blocks_and_index_objects(path, fmt, knobs["block_bytes"])
                                  for path in locals_.values()), strict=True)
    worst = {key: max(result["waits"][key] for result in run) for key in run[0]["waits"]}
    sized = [result["sizing"] for result in run if result["sizing"]]
    fetch_p99 = max((sizing["fetch_p99_ms"] for sizing in sized), default=0)
    read_ahead = min((sizing["read_ahead_ms"] for sizing in sized), default=0)
    least = max((sizing["least_cache_bytes"] for sizing in sized), default=0) / dataset
    trained = (min(r["trained"][0] for r in run), max(r["trained"][1] for r in run))
    requests = gets + heads - sum(index_objects) * nodes  # those while training
    load = requests / max(trained[1] - trained[0], 1e-9) / args.capacity
    missed = (worst["data_wait_p99_ms"] > WAIT_P99_MS or worst["data_wait_max_ms"] > WAIT_MAX_MS)
    row = [f"{size} {dataset / len(shards) / len(locals_) / 1e6:.2f} MB", f"{per_rank:g}",
           f"{share:.0%}", f"{nodes}x2", f"{len(shards) * len(locals_)}",
           layout_text(knobs),
           f"{sum(r['fetched'] for r in run) / dataset:.2f}",
           f"{gets / (sum(blocks) + sum(index_objects) * nodes):.2f}",
           f"{heads / sum(blocks):.2f}",
           f"{worst['data_wait_p99_ms']:.0f}", f"{worst['data_wait_max_ms']:.0f}",
           f"{fetch_p99:.0f}", f"{read_ahead:,.0f}", f"{least:.0%}" if least > share else "-",
           f"{load:.0%}", advised_text(run), f"{sum(result['on_read'] for result in run)}",
           f"{worst['data_wait_first_batch_s']:.2f}", str(same), resumed]
    return (row, first_quality(local, fmt, shards, knobs, ranks, budget // len(locals_)),
            least if missed and least > share else 0.0)


def advised_text(run: list[dict]) -> str:
    """The block_bytes rank 0's mixing advice named (raypipe.loader.mixing), or "-"."""
    advised = run[0]["advised_block_bytes"]
    return f"{advised / 1e3:,.0f} KB" if advised else "-"


def resolved_layout(knobs: dict) -> dict:
    """The shuffle and layout a run resolved, from its state's knobs (a state leaves out
    whole shards)."""
    layout = {"shuffle": knobs["shuffle"], "block_bytes": WHOLE_SHARDS, "window_blocks": 0}
    layout.update({name: knobs[name] for name in ("block_bytes", "window_blocks", "lanes",
                                                  "lane_ranks", "group_shards")
                   if name in knobs})
    return layout


def layout_text(knobs: dict) -> str:
    """`block x window` (a windowed shuffle), else the shuffle and its group."""
    if knobs["shuffle"] != "windowed":
        return f"{knobs['shuffle']} {knobs.get('group_shards', '')}".strip()
    block = int(knobs["block_bytes"])
    size = "shards" if block >= WHOLE_SHARDS else f"{block / 1e3:,.0f} KB"
    shared = f", {knobs['lane_ranks']} ranks a lane" if knobs.get("lane_ranks", 1) > 1 else ""
    return f"{size} x {knobs['window_blocks'] or 'auto'}{shared}"


def blocks_and_index_objects(local: Path, fmt: str, block_bytes: int) -> tuple[int, int]:
    """A dataset's block reads of `block_bytes` (a block a file it is read from: chat
    data's mask too), and the objects every node reads whole at open: each shard's index
    files (Megatron: its .idx and its .sums)."""
    opened = TokenDataset(local, fmt)
    shards, lengths = opened.shards, opened.document_lengths()
    counts = np.array([shard.documents for shard in shards], dtype=np.int64)
    suffixes = get_format(fmt).index_suffixes
    index_objects = sum(bool(suffixes) and f.path.endswith(suffixes) for shard in shards
                        for f in shard.files)
    blocks = cut_blocks(DocumentLengths(counts, lambda s: lengths[
        counts[:s].sum():counts[:s + 1].sum()]), counts,
        opened.block_itemsize, int(block_bytes))
    return len(blocks) * opened.files_a_block, index_objects


def first_quality(local: Path, fmt: str, shards: list, knobs: dict, ranks: int,
                  budget: int) -> list[tuple[str, ...]]:
    """The shuffle's quality on a dataset's documents at a source's `budget`."""
    opened = TokenDataset(local, fmt)
    counts = np.array([shard.documents for shard in shards], dtype=np.int64)
    suffixes = get_format(fmt).index_suffixes
    index_bytes = sum(f.bytes for shard in shards for f in shard.files
                      if suffixes and f.path.endswith(suffixes[0]))
    return quality(opened.document_lengths(), counts, knobs, ranks, budget, index_bytes,
                   opened.block_itemsize)


HEADER = ("shards", "per rank", "cache", "nodes", "count", "block x window",
          "bytes/data", "GETs/blocks", "HEADs/blocks", "p99 ms", "max ms", "fetch p99 ms",
          "read-ahead ms", "least cache", "harness load", "advised block", "on read",
          "first s", "= local", "2->3")


def parsed_cell(text: str) -> tuple[str, float, float, int]:
    """A --cell: (shard size, shards per rank, cache share, nodes)."""
    size, per_rank, share, nodes = text.split(",")
    if size not in SHARD_TOKENS:
        raise SystemExit(f"--cell {text}: the shard size is one of {sorted(SHARD_TOKENS)}")
    return size, float(per_rank), float(share), int(nodes)


def cell_row(args: argparse.Namespace, workdir: Path, shape: tuple[str, float, float, int],
             advised: str = "") -> tuple[list[str], list[tuple[str, ...]], float]:
    """A cell's row (a refusal's: what the rank said), its quality rows and the cache share
    advised (`cell`); `advised` marks a cell run at the cache its first run's loader named
    (no resume)."""
    began = time.perf_counter()
    size, per_rank, share, nodes = shape
    if advised:
        share = math.ceil(share * 100) / 100
    try:
        row, quality_rows, least = cell(args, workdir, size, per_rank, share, nodes,
                                        resume=not advised)
    except RankFailed as failed:
        row = [size, f"{per_rank:g}", f"{share:.0%}", f"{nodes}x2", "refused:",
               str(failed)[:120], *[""] * (len(HEADER) - 6)]
        quality_rows, least = [], 0.0
    if advised:
        row[2] = f"{row[2]} ({advised})"
    print(f"  {' | '.join(row)}  ({time.perf_counter() - began:.0f} s)", flush=True)
    return row, quality_rows, least


def bench(args: argparse.Namespace, workdir: Path) -> None:
    chat = " of chat data" if args.chat else ""
    print(f"{args.format} shards{chat}; proxy {args.delay_ms:.0f} ms a request, "
          f"{args.slow_down:.0%} 503 SlowDown, "
          f"{args.resets:.0%} resets; one epoch, bestfit T={SEQ}, {BATCH} rows a rank, "
          f"consumer step {args.step_ms:g} ms; "
          + (f"cells {args.cell}" if args.cell else f"grid {args.grid!r}"))
    args.capacity = serving_capacity(args.delay_ms)
    print(f"the harness (moto behind the proxy, {os.cpu_count()} cores) serves at most "
          f"{args.capacity:,.0f} ranged GETs of 16 KiB a second")
    rows, qualities = [HEADER], []
    for shape in [parsed_cell(text) for text in args.cell] or GRIDS[args.grid]:
        row, quality_rows, advised = cell_row(args, workdir, shape)
        rows.append(tuple(row))
        if quality_rows:
            qualities.append((shape, quality_rows))
        if advised and args.follow_advice:  # the cell again at the cache the loader named
            size, per_rank, _, nodes = shape
            row, _, _ = cell_row(args, workdir, (size, per_rank, advised, nodes), "advised")
            rows.append(tuple(row))
    print()
    print_table(rows)
    for (size, per_rank, share, nodes), quality_rows in qualities:
        print(f"\nshuffle quality: {size} shards, {per_rank:g} a rank, cache {share:.0%}, "
              f"{nodes}x2 ranks")
        print_table([("order", "P(next same shard) / uniform", "shards a rank batch",
                      "shards a step", "shards in 1% of epoch"), *quality_rows])
    print("\nprojection: 10^4 shards of 400 MB on 125 nodes x 8 ranks, a 10% cache")
    print_table(projection())
    print("\n... under a given block_bytes (4 M tokens a step, 1 step/s)")
    print_table(block_tradeoffs())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--grid", choices=sorted(GRIDS), default="quick")
    parser.add_argument("--delay-ms", type=float, default=20)
    parser.add_argument("--slow-down", type=float, default=0.05)
    parser.add_argument("--resets", type=float, default=0.01)
    parser.add_argument("--workdir", default="bench_out")
    parser.add_argument("--step-ms", type=float, default=STEP_S * 1000,
                        help="the consumer's step (the training loop's time a batch)")
    parser.add_argument("--cell", action="append", default=[],
                        help="run this cell instead of a grid: small|large,PER_RANK,SHARE,"
                        "NODES (e.g. small,200,0.1,1); repeatable")
    parser.add_argument("--mixture", action="store_true",
                        help="every cell a mixture of two datasets on the bucket")
    parser.add_argument("--chat", action="store_true",
                        help="chat data: the shards carry a loss mask sidecar")
    parser.add_argument("--lane-ranks", type=int, default=0,
                        help="lane_ranks: the ranks of a node read one lane in turn (2: a "
                        "node's; 0: the loader's default, a lane a rank)")
    parser.add_argument("--free-running", action="store_true",
                        help="the rank processes run free (default: in lockstep, a barrier "
                        "after each step, as a data-parallel step's all-reduce keeps them)")
    parser.add_argument("--block-bytes", type=int, default=0,
                        help="the loader's block_bytes (0: automatic)")
    parser.add_argument("--follow-advice", action="store_true",
                        help="run a cell whose waits miss the target again at the least "
                        "cache_bytes its loader named (as a share of the data)")
    parser.add_argument("--format", default="megatron",
                        choices=document_formats(),
                        help="the document format of the cells' shards")
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


if __name__ == "__main__":
    main()
