"""Tokenize benchmark: the raypipe job on 2 Ray CPUs against the two-process ceiling.

    python bench/tokenize_bench.py [--mb 50] [--workdir bench_out]

Both sides run in the same Ray session (the ceiling's processes are plain `multiprocessing`
ones, outside Ray), alternated `--repeats` times; the best of each is printed.
Prints, from one run: Ray start-up; the raypipe job (read + tokenize + write, Megatron
format, 2 actors) in steady state (first unit started to last unit committed, so the actor
pool's start-up is reported apart) and whole; the ceiling: two plain processes, each with
one tokenizer thread, each tokenizing half of the same texts with the same tokenizer call
(`encode_batch_fast`) and writing the same bytes; the ratio (target >= 0.9); and each
actor's peak RSS at two batch sizes, which must follow the batch size, not the corpus.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path

import numpy as np
from common import corpus_texts, docstring_corpus, print_table

from raypipe.demo.train_tokenizer import SHIPPED
from raypipe.preprocess.encoder import flatten_documents, ids_of, single_threaded_tokenizers

BATCH = 1024


def ceiling_worker(texts: list[list[str]], out_path: str, start: mp.Event, queue: mp.Queue):
    single_threaded_tokenizers()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(SHIPPED))
    bos = tokenizer.token_to_id("<|bos|>")
    start.wait()
    began = time.perf_counter()
    tokens_total = 0
    with open(out_path, "wb") as handle:
        for file_texts in texts:
            for first in range(0, len(file_texts), BATCH):
                ids = ids_of(tokenizer, file_texts[first:first + BATCH])
                tokens, _ = flatten_documents(ids, bos, None)
                handle.write(tokens.astype(np.uint16).data)
                tokens_total += tokens.size
        os.fsync(handle.fileno())
    queue.put((time.perf_counter() - began, tokens_total))


def run_ceiling(corpus: Path, workdir: Path) -> tuple[float, int]:
    per_file = corpus_texts(corpus)
    halves = [per_file[0::2], per_file[1::2]]
    context = mp.get_context("spawn")
    start, queue = context.Event(), context.Queue()
    procs = [context.Process(target=ceiling_worker,
                             args=(half, str(workdir / f"ceiling-{i}.bin"), start, queue))
             for i, half in enumerate(halves)]
    for proc in procs:
        proc.start()
    time.sleep(3)  # both processes loaded their texts and tokenizer
    wall_start = time.perf_counter()
    start.set()
    results = [queue.get() for _ in procs]
    wall = time.perf_counter() - wall_start
    for proc in procs:
        proc.join()
    return wall, sum(tokens for _, tokens in results)


def run_raypipe(corpus: Path, output: Path, batch_size: int = BATCH):
    from raypipe.config import load_config
    from raypipe.ray.executor import run_tokenize

    shutil.rmtree(output, ignore_errors=True)
    config = load_config(None, inputs=[str(corpus)], output=str(output), tokenizer=str(SHIPPED),
                         formats=["megatron"], num_workers=2, encode_batch_rows=batch_size,
                         unit_bytes=2 << 20)
    return run_tokenize(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    parser.add_argument("--repeats", type=int, default=2, help="best of N for each side")
    args = parser.parse_args()
    args.workdir.mkdir(exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback
    corpus = docstring_corpus(args.workdir, args.mb << 20)
    size = sum(p.stat().st_size for p in corpus.glob("*.parquet"))
    print(f"corpus: {corpus} ({size / 1e6:.1f} MB parquet)")

    import ray

    began = time.perf_counter()
    ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=False)
    startup = time.perf_counter() - began
    ceilings, jobs = [], []
    try:
        small = run_raypipe(corpus, args.workdir / "raypipe-rss-small", batch_size=64)
        for _ in range(args.repeats):  # alternate, so both see the same machine noise
            ceilings.append(run_ceiling(corpus, args.workdir))
            jobs.append(run_raypipe(corpus, args.workdir / "raypipe"))
    finally:
        ray.shutdown()
    ceiling_wall, ceiling_tokens = min(ceilings)
    job = max(jobs, key=lambda j: j.steady_tokens_per_second)
    ceiling_rate = ceiling_tokens / ceiling_wall
    job_rate = job.tokens_run / job.run_seconds
    steady_rate = job.steady_tokens_per_second
    print_table([
        ("what", "tokens", "seconds", "M tokens/s", "vs ceiling"),
        ("ceiling: 2 processes x 1 thread", f"{ceiling_tokens:,}", f"{ceiling_wall:.2f}",
         f"{ceiling_rate / 1e6:.3f}", "1.00"),
        ("raypipe job, steady state", f"{job.tokens_run:,}", f"{job.steady_seconds:.2f}",
         f"{steady_rate / 1e6:.3f}", f"{steady_rate / ceiling_rate:.2f}"),
        ("raypipe job incl. actor start", f"{job.tokens_run:,}", f"{job.run_seconds:.2f}",
         f"{job_rate / 1e6:.3f}", f"{job_rate / ceiling_rate:.2f}"),
    ])
    print(f"Ray start-up (ray.init): {startup:.2f} s; actor pool start-up inside the job: "
          f"{job.run_seconds - job.steady_seconds:.2f} s")
    print(f"raypipe job wall incl. planning and manifest: {job.wall_seconds:.2f} s")
    print(f"peak RSS per actor: batch 64 -> {small.peak_rss_bytes / 2**20:.0f} MiB, "
          f"batch {BATCH} -> {job.peak_rss_bytes / 2**20:.0f} MiB "
          f"(corpus {size / 2**20:.0f} MiB, largest shard "
          f"{max(s['files'][0]['bytes'] for s in _shards(args.workdir / 'raypipe')) / 2**20:.1f}"
          " MiB)")
    ratio = steady_rate / ceiling_rate
    print(f"RATIO raypipe/ceiling = {ratio:.2f} (target >= 0.90): "
          f"{'PASS' if ratio >= 0.9 else 'BELOW TARGET'}")


def _shards(output: Path) -> list[dict]:
    import json

    return json.loads((output / "manifest.json").read_text())["formats"]["megatron"]["shards"]


if __name__ == "__main__":
    main()
