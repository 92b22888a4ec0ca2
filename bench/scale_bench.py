"""Scale benchmark: a loader rank's costs at 10^6 to 10^8 documents in 10 to 10^4 shards.

    python bench/scale_bench.py [--sizes 1e6:10,1e7:1000,1e8:10000] [--workdir bench_out]

Datasets are synthetic but real where it is read: Megatron `.idx` files written by raypipe's
own index encoder (lognormal document lengths, median ~400 tokens), a manifest built by
raypipe's manifest builder, and sparse `.bin` files of the right size (their pages read as
zeros; their sha256 is a placeholder, so `raypipe verify` refuses them, and the loader,
which checks size and modification time, opens them); for the batches mode, the LLMBATCH
files the same tokens would fill (records of 2049, 8 a batch, in as many files as shards:
real headers, sparse batch slots). Each measurement runs in a fresh
process under `ulimit -n 256`, as rank 999 of 1,000 (and rank 0), T = 2048, B = 8, first
with an empty node plan cache ("cold": the first rank of a node, once per dataset, seed and
epoch), then with the cache the cold run left ("warm": every other rank of the node):
- start: constructing the loader to its first batch;
- resume: a 1,000-rank state loaded by rank 998 of 999, to its first batch;
- prepare: building the next epoch's plan on the loader's background thread (it starts
  halfway through an epoch; bestfit's block sums go to the node's plan cache);
- epoch boundary: then taking that plan (what the first step of an epoch waits for);
- step: CPU seconds per step over 20 steps;
- private memory: RssAnon growth from after the imports to after those steps (maps of the
  index and token files are shared page cache, not counted), per document;
- open files at the end, and bytes read (rchar) before the first batch;
- change (bestfit): the resume's state loaded into a loader at seq_len 8192 (B = 2), to
  its first batch: the rest of the epoch planned again from what the state had not served
  (raypipe.sampling.schedule.Phase), and the private memory that adds;
- trace: `raypipe.trace` of the rank's rows at the middle step of epoch 1 (a step whose
  epoch 0 must be sized first), in the probe's process after its loader (document modes; the
  synthetic LLMBATCH output has no document shards to map its records back to).
Targets at 10^8 documents in 10^4 shards, rank 999 with a warm node cache, every mode: start
and resume <= 5 s, epoch boundary <= 1 s, private memory <= 1 B/document + 64 MiB, trace
<= 5 s, all under ulimit -n 256; a seq_len change <= resume + one block's re-plan.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import print_table

from raypipe.formats.llmbatch import encode_header, slot_bytes
from raypipe.formats.megatron import encode_index
from raypipe.io.atomic import file_sha256
from raypipe.io.manifest import write_manifest
from raypipe.io.records import FileEntry, FormatSection, Manifest, ShardEntry, TokenizerInfo, Totals

MODES = ("windows", "bestfit", "documents", "batches")
LIMIT_FILES = 256
PROBE = r"""
import json, os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
import numpy as np, torch
from raypipe.loader import TokenLoader


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


def rchar():
    for line in open("/proc/self/io"):
        if line.startswith("rchar"):
            return int(line.split()[1])


path, mode, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
base_memory, base_read = status("RssAnon:"), rchar()
began = time.perf_counter()
shape = {{}} if mode == "batches" else {{"seq_len": 2048, "batch_size": 8}}
loader = TokenLoader(path, mode=mode, rank=rank, world_size=1000, seed=1, **shape)
batches = iter(loader)
next(batches)
start = time.perf_counter() - began
read_first = rchar() - base_read
cpu = time.process_time()
for _ in range(20):
    next(batches)
step = (time.process_time() - cpu) / 20
state = loader.state_dict()
began = time.perf_counter()
resumed = TokenLoader(path, mode=mode, rank=min(rank, 998), world_size=999, seed=1, **shape)
resumed.load_state_dict(state)
next(iter(resumed))
resume = time.perf_counter() - began
began = time.perf_counter()
loader.run.prepare_epoch(loader.epoch + 1).join()  # what the loader starts halfway through
prepare = time.perf_counter() - began
began = time.perf_counter()
loader.plan(loader.epoch + 1)
boundary = time.perf_counter() - began
private = status("RssAnon:") - base_memory  # the loader's, before trace runs here
changed, change_memory = -1.0, 0
if mode == "bestfit":  # the same state into a loader at 4x the seq_len: the change's cost
    before = status("RssAnon:")
    began = time.perf_counter()
    longer = TokenLoader(path, mode=mode, rank=min(rank, 998), world_size=999, seed=1,
                         seq_len=8192, batch_size=2)
    longer.load_state_dict(state)
    next(iter(longer))
    changed = time.perf_counter() - began
    change_memory = status("RssAnon:") - before
traced = -1.0
if mode != "batches":
    from raypipe.tools.trace import trace
    middle = loader.steps_in_epoch(0) + loader.steps_in_epoch(1) // 2
    began = time.perf_counter()
    pieces = list(trace(path, middle, rank=rank, world_size=1000, seed=1, mode=mode, **shape))
    traced = time.perf_counter() - began
    assert pieces
print(json.dumps({{"start": start, "resume": resume, "boundary": boundary, "step": step,
                  "prepare": prepare, "trace": traced, "change": changed,
                  "change_memory": change_memory,
                  "private": private,
                  "files": len(os.listdir("/proc/self/fd")), "read_first": read_first}}))
"""


def build(directory: Path, documents: int, shards: int, seed: int = 0) -> Path:
    """The synthetic dataset (built once per size and cached in `directory`)."""
    output = directory / f"scale-{documents:.0e}-{shards}".replace("+", "")
    if (output / "manifest.json").exists():
        return output
    (output / "megatron").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_shard = np.full(shards, documents // shards)
    per_shard[: documents % shards] += 1
    entries, tokens_total = [], 0
    for index, count in enumerate(per_shard.tolist()):
        name = f"shard-{index:05d}"
        lengths = np.clip(rng.lognormal(6.0, 1.0, count).astype(np.int64) + 2, 2, 100_000)
        idx_path = output / "megatron" / f"{name}.idx"
        idx_path.write_bytes(encode_index(lengths, np.dtype(np.uint16)))
        bin_path = output / "megatron" / f"{name}.bin"
        with open(bin_path, "wb") as handle:
            handle.truncate(int(lengths.sum()) * 2)  # sparse: no blocks written
        files = []
        for path, digest in ((bin_path, "0" * 64), (idx_path, file_sha256(idx_path))):
            stat = path.stat()
            files.append(FileEntry(f"megatron/{path.name}", stat.st_size, digest,
                                   stat.st_mtime_ns))
        entries.append(ShardEntry(name, tuple(files), count, int(lengths.sum())))
        tokens_total += int(lengths.sum())
    info = TokenizerInfo("synthetic", "0" * 64, 32767, 0, None)
    section = FormatSection("uint16", tuple(entries), {})
    totals = Totals(rows=documents, documents=documents, tokens=tokens_total)
    write_manifest(output, Manifest.build(f"scale-{documents}-{shards}", info,
                                          {"megatron": section}, {}, totals=totals))
    return output


def build_llmbatch(directory: Path, documents: int, shards: int) -> Path:
    """The LLMBATCH output the same corpus would have: records of 2049 tokens (the corpus's
    tokens / 2049), 8 a batch, in `shards` files: headers written by raypipe's encoder,
    batch slots sparse."""
    output = directory / f"scale-llmbatch-{documents:.0e}-{shards}".replace("+", "")
    if (output / "manifest.json").exists():
        return output
    (output / "llmbatch").mkdir(parents=True, exist_ok=True)
    batch, record = 8, 2049
    tokens = documents * 660  # the mean length of build()'s lognormal documents
    total_batches = tokens // record // batch
    per_shard = -(-total_batches // shards)
    entries = []
    for index, first in enumerate(range(0, total_batches, per_shard)):
        count = min(per_shard, total_batches - first)
        path = output / "llmbatch" / f"batches-{index:05d}.batch"
        with open(path, "wb") as handle:
            handle.write(encode_header(batch, record, count, 0, total_batches * batch))
            handle.truncate(4096 + count * slot_bytes(batch, record))  # sparse slots
        stat = path.stat()
        digest = file_sha256(path) if stat.st_size < 1 << 20 else "0" * 64
        entries.append(ShardEntry(path.stem, (FileEntry(f"llmbatch/{path.name}", stat.st_size,
                                                         digest, stat.st_mtime_ns),),
                                  first_batch=first, batches=count))
    options = {"record_len": record, "batch_size": batch, "packing": "fill", "seed": 0,
               "total_records": total_batches * batch, "num_batches": total_batches,
               "source_format": "megatron", "used_tokens": total_batches * batch * record,
               "cropped_tokens": 0, "padded_tokens": 0, "dropped_tokens": 0}
    info = TokenizerInfo("synthetic", "0" * 64, 32767, 0, None)
    section = FormatSection("uint32", tuple(entries), options)
    write_manifest(output, Manifest.build(f"scale-llmbatch-{documents}", info,
                                          {"llmbatch": section}, {},
                                          totals=Totals(documents=documents, tokens=tokens)))
    return output


def probe(path: Path, mode: str, rank: int, cache_dir: Path) -> dict:
    environment = {**os.environ, "RAYPIPE_CACHE_DIR": str(cache_dir)}
    result = subprocess.run([sys.executable, "-c", PROBE.format(limit=LIMIT_FILES), str(path),
                             mode, str(rank)], capture_output=True, text=True, timeout=1800,
                            env=environment)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or [f"exit status {result.returncode}"]
        return {"error": lines[-1][:120]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def parse_sizes(text: str) -> list[tuple[int, int]]:
    return [(int(float(docs)), int(shards)) for docs, shards in
            (item.split(":") for item in text.split(","))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1e6:10,1e7:1000,1e8:10000",
                        help="documents:shards, comma separated")
    parser.add_argument("--ranks", default="999,0")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    args.workdir.mkdir(exist_ok=True)
    rows = [("documents", "shards", "mode", "rank", "cache", "start s", "resume s",
             "prepare s", "boundary s", "ms/step", "private MiB", "B/doc", "files",
             "MB read", "trace s", "change s", "change MiB")]
    verdicts = []
    ranks = [int(rank) for rank in args.ranks.split(",")]
    for documents, shards in parse_sizes(args.sizes):
        began = time.perf_counter()
        documents_path = build(args.workdir, documents, shards)
        print(f"dataset {documents_path.name}: built or found in "
              f"{time.perf_counter() - began:.1f} s",
              flush=True)
        batches = build_llmbatch(args.workdir, documents, shards)
        for mode in args.modes.split(","):
            cache_dir = Path(tempfile.mkdtemp(prefix="plans-", dir=args.workdir))
            path = batches if mode == "batches" else documents_path
            runs = [(rank, "cold" if index == 0 else "warm")
                    for index, rank in enumerate([ranks[0], *ranks])]
            for rank, cache in runs:
                got = probe(path, mode, rank, cache_dir)
                head = (f"{documents:.0e}", str(shards), mode, str(rank), cache)
                if "error" in got:
                    rows.append((*head, got["error"], *[""] * 11))
                    verdicts.append(False)
                    continue
                rows.append((*head, f"{got['start']:.2f}", f"{got['resume']:.2f}",
                             f"{got['prepare']:.2f}", f"{got['boundary']:.2f}",
                             f"{got['step'] * 1e3:.1f}", f"{got['private'] / 2**20:.0f}",
                             f"{got['private'] / documents:.2f}", str(got["files"]),
                             f"{got['read_first'] / 1e6:.0f}",
                             f"{got['trace']:.2f}" if got["trace"] >= 0 else "-",
                             f"{got['change']:.2f}" if got["change"] >= 0 else "-",
                             f"{got['change_memory'] / 2**20:.0f}" if got["change"] >= 0
                             else "-"))
                if documents >= 10**8 and rank == 999 and cache == "warm":
                    verdicts.append(got["start"] <= 5 and got["resume"] <= 5
                                    and got["boundary"] <= 1 and got["trace"] <= 5
                                    and got["private"] <= documents + 64 * 2**20)
                print("  ".join(rows[-1]), flush=True)
            shutil.rmtree(cache_dir, ignore_errors=True)
    print()
    print_table(rows)
    if verdicts:
        print("TARGETS " + ("PASS" if all(verdicts) else f"MISSED {verdicts}"))


if __name__ == "__main__":
    os.environ.setdefault("RAYPIPE_LOG_LEVEL", "WARNING")
    main()
