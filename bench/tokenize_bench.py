"""Tokenize benchmark: raypipe on 2 Ray CPUs against the two-process ceiling of each encoder
backend and each library's own loop, and against datatrove, end to end; and the units
against each backend's bare call, with where their CPU goes; on the same corpus and
tokenizer.

    python bench/tokenize_bench.py [--mb 200] [--tokenizer gpt2|shipped|llama3-style]
                                   [--corpus unique|shuffled|docstrings] [--workdir bench_out]

The corpus (`unique`, the default) is text that never repeats (bench/common.unique_corpus:
the machine's docstrings and text files, deduplicated by content: no encoder cache can
flatter it; this machine holds ~500 MB of it); `shuffled` adds documents made by shuffling
those documents' sentences until --mb (bench/common.shuffled_corpus: `--mb 1024` is the
1 GB run; words and sentences repeat, documents do not); `docstrings` repeats the
docstrings to --mb. The tokenizer is GPT-2's (bench/gpt2_tokenizer.py), the shipped 8k BPE,
or a Llama-3-style `Split`-regex vocabulary trained on the corpus; BOS off, EOS on,
Megatron output. Every contender runs in fresh processes (a fresh encoder object),
alternated --repeats times; the best of each is printed:
- ceiling, per backend: two plain processes, one encoder thread each, each encoding half of
  the texts (already in memory) with the call raypipe makes and writing the same bytes;
- library loop, per library (tokenizers, tiktoken, fastokens, gigatoken): the same two
  processes, a loop of single-document calls (`encode(...).ids`, tiktoken's
  `encode_ordinary`, fastokens' `encode_ordinary(...).ids`, gigatoken's `encode`);
- units against the bare call, per backend and `auto`: a serial job (one process, no Ray:
  the units' own code) whose unit records' `cpu_seconds` give the units' rate, against
  the backend's own batch call (`encode_flat` of 1,024 texts) on the same texts already in
  memory, in a fresh process, by its process CPU time, and against the least a unit must
  do (read each file's texts, encode them with that call, write a .bin per file, nothing
  else); the ratios, auto's against the fastest bare call, and where auto's units spend
  their CPU (a profiled run, grouped: encoding, reading, finding bad rows, separators,
  sha256, writing, the rest) (`--units-only`: this alone);
- raypipe, per backend, end to end in a fresh process, as `raypipe tokenize --executor
  ray` runs (the Megatron race also runs it as typed, on local processes): the job
  starts a local Ray (2 CPUs, loopback, self-check meanwhile), plans, runs one Ray Data
  Dataset (from_items(units) -> map_batches as Ray tasks, 2 at a time) that reads parquet,
  encodes, writes; commits the manifest (~32 work units), then stops its Ray (`leave_ray`;
  on a cluster it disconnects); the wall is the process's, from its launch to its exit; also
  Ray Data's start-up, the units' own rate (tokens over the CPU seconds units took, against the
  ceiling's per-process rate) and where the run's core-seconds went: tokenizing units,
  everything else (Ray's and Ray Data's processes, the driver outside units: sampled from
  /proc over the job's process tree), and idle;
- with --cluster, raypipe (auto) against a running cluster (`ray start --head`, 2 CPUs,
  then `address`), as a `ray job submit` job runs: no Ray start per job;
- datatrove (if installed: `pip install datatrove`), end to end in a fresh process:
  ParquetReader -> DocumentTokenizer (the same tokenizer.json through `tokenizers`, EOS,
  no shuffle), 16 tasks on 2 workers; the process's wall, launch to exit.
Targets (raypipe `auto` = gigatoken where it is installed and exact, else fastokens): its
units' per-core rate >= 3x the tiktoken loop's, and their CPU seconds <= 1/3 of the
tiktoken job's; the units >= 0.8 of their backend's bare call; end to end >= 4x datatrove
at 200 MB and >= 0.6x the ceiling of its backend at 1 GB (goals, reported met or not);
peak RSS per actor follows the batch size, not the corpus.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from queue import Empty

import numpy as np
from common import (
    corpus_texts,
    docstring_corpus,
    free_port,
    print_table,
    shuffled_corpus,
    unique_corpus,
)
from gpt2_tokenizer import gpt2_tokenizer_json
from megatron_race import race

from raypipe.demo.train_tokenizer import LLAMA3_SPLIT, SHIPPED, train_bpe
from raypipe.preprocess.encoding.encoder import DocumentEncoder, single_threaded_tokenizers

BATCH = 1024
CORES = 2  # Ray's CPUs in every run, and the ceiling's processes
# a ceiling's backend -> the raypipe flag that runs it (auto picks fastokens when installed)
JOB_BACKEND = {"tokenizers": "tokenizers", "tiktoken": "tiktoken", "fastokens": "fastokens",
               "gigatoken": "auto"}
BACKENDS = tuple(JOB_BACKEND)
READY = "ready"  # what a ceiling process says once its texts and tokenizer are loaded
EOS = {"gpt2": "<|endoftext|>", "shipped": "<|eos|>", "llama3-style": "<|eos|>"}


def ceiling_worker(texts: list[list[str]], tokenizer_path: str, eos: str, backend: str,
                   out_path: str, start: mp.Event, queue: mp.Queue) -> None:
    single_threaded_tokenizers()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    encoder = DocumentEncoder(tokenizer, None, tokenizer.token_to_id(eos), "text", backend)
    queue.put(READY)
    start.wait()
    began = time.perf_counter()
    tokens_total = 0
    with open(out_path, "wb") as handle:
        for file_texts in texts:
            for first in range(0, len(file_texts), BATCH):
                tokens, _ = encoder.encode(file_texts[first:first + BATCH])
                handle.write(tokens.astype(np.uint16).data)
                tokens_total += tokens.size
        os.fsync(handle.fileno())
    queue.put((time.perf_counter() - began, tokens_total))


def loop_worker(texts: list[list[str]], tokenizer_path: str, eos: str, library: str,
                out_path: str, start: mp.Event, queue: mp.Queue) -> None:
    """A library's own loop of single-document calls (no raypipe code on the hot path but
    the tiktoken conversion of the tokenizer.json); writes nothing but counts tokens."""
    single_threaded_tokenizers()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    if library == "tokenizers":
        tokenizer.encode_special_tokens = True

        def encode(text: str) -> int:
            return len(tokenizer.encode(text, add_special_tokens=False).ids)
    elif library == "tiktoken":
        from raypipe.preprocess.encoding.encoder import tokenizer_sha256
        from raypipe.preprocess.encoding.tiktoken_backend import encoding_for

        encoding = encoding_for(tokenizer, tokenizer_sha256(tokenizer))[0]

        def encode(text: str) -> int:
            return len(encoding.encode_ordinary(text))
    elif library == "gigatoken":
        from raypipe.preprocess.encoding.encoder import tokenizer_sha256
        from raypipe.preprocess.encoding.gigatoken_backend import model_for

        model = model_for(tokenizer, tokenizer_sha256(tokenizer), "text")

        def encode(text: str) -> int:
            return len(model.encode(text))
    else:
        import fastokens

        model = fastokens.Tokenizer.from_file(tokenizer_path)

        def encode(text: str) -> int:
            return len(model.encode_ordinary(text).ids)
    queue.put(READY)
    start.wait()
    began = time.perf_counter()
    tokens_total = sum(encode(text) for file_texts in texts for text in file_texts)
    queue.put((time.perf_counter() - began, tokens_total))


def run_ceiling(corpus: Path, workdir: Path, tokenizer: Path, eos: str,
                backend: str, worker=ceiling_worker) -> tuple[float, int]:
    per_file = corpus_texts(corpus)
    halves = [per_file[0::2], per_file[1::2]]
    context = mp.get_context("spawn")
    start, queue = context.Event(), context.Queue()
    procs = [context.Process(target=worker,
                             args=(half, str(tokenizer), eos, backend,
                                   str(workdir / f"ceiling-{i}.bin"), start, queue))
             for i, half in enumerate(halves)]
    for proc in procs:
        proc.start()
    wait_until_ready(procs, queue)
    wall_start = time.perf_counter()
    start.set()
    results = [queue.get() for _ in procs]
    wall = time.perf_counter() - wall_start
    for proc in procs:
        proc.join()
    return wall, sum(tokens for _, tokens in results)


def wait_until_ready(procs: list, queue: mp.Queue) -> None:
    """Return once every process has loaded its texts and tokenizer (the clock starts
    then, whatever the machine's load); raise if one died first."""
    ready = 0
    while ready < len(procs):
        try:
            said = queue.get(timeout=1)
        except Empty:
            dead = [proc.exitcode for proc in procs if proc.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a ceiling process died loading (exit codes {dead})") from None
            continue
        if said != READY:
            raise RuntimeError(f"a ceiling process reported {said!r} before it was ready")
        ready += 1


RAYPIPE_JOB = """
import json, sys
from raypipe.config import load_config
from raypipe.ray.executor import run_on_ray as run_tokenize
from raypipe.ray.session import leave_ray
from raypipe.io.store import Store
from raypipe.preprocess.output import unit_records
corpus, output, tokenizer, backend, batch, unit_bytes, address = sys.argv[1:8]
config = load_config(None, inputs=[corpus], output=output, tokenizer=tokenizer,
                     formats=["megatron"], num_workers=2, encode_batch_rows=int(batch),
                     unit_bytes=int(unit_bytes), bos=False, eos=True,
                     tokenizer_backend=backend, address=address or None)
summary = run_tokenize(config)  # starts a local Ray (2 CPUs) unless given an address
print(json.dumps({"ray_start": summary.startup_seconds, "tokens": summary.tokens_run,
                  "data_start": summary.data_startup_seconds,
                  "units": summary.units,
                  "unit_cpu": sum(r.cpu_seconds for _, r in unit_records(Store(output))),
                  "backend": summary.backend, "rss": summary.peak_rss_bytes}), flush=True)
leave_ray()  # as `raypipe tokenize` does once its summary is printed
"""

UNIT_RATE_JOB = """
import cProfile, json, pstats, sys
from raypipe.config import load_config
from raypipe.io.store import Store
from raypipe.preprocess import runners
from raypipe.preprocess.job import run_job
from raypipe.preprocess.output import unit_records
corpus, output, tokenizer, backend, profile = sys.argv[1:6]
config = load_config(None, inputs=[corpus], output=output, tokenizer=tokenizer,
                     formats=["megatron"], encode_batch_rows=1024, bos=False, eos=True,
                     tokenizer_backend=backend)
profiler = cProfile.Profile()
if profile:  # only the units' own calls, as a Ray actor runs them
    unit = runners.tokenize_unit
    def profiled(*args, **kwargs):
        profiler.enable()
        try:
            return unit(*args, **kwargs)
        finally:
            profiler.disable()
    runners.tokenize_unit = profiled
summary = run_job(config)  # the serial runner: the units in this process, no Ray
records = [record for _, record in unit_records(Store(output))]
where = {}
if profile:
    for (path, _, name), row in pstats.Stats(profiler).stats.items():
        where[f"{path}:{name}"] = row[2]  # own time
print(json.dumps({"cpu": sum(r.cpu_seconds for r in records), "backend": summary.backend,
                  "tokens": sum(r.tokens for r in records),
                  "documents": sum(r.documents for r in records), "where": where}))
"""

BARE_CALL = """
import glob, json, sys, time
import pyarrow.parquet as pq
from tokenizers import Tokenizer
from raypipe.preprocess.encoding.backends import FAST_BACKENDS
from raypipe.preprocess.encoding.encoder import tokenizer_sha256
from raypipe.preprocess.texts import clean_texts
corpus, tokenizer_path, backend = sys.argv[1:4]
from raypipe.preprocess.encoding.encoder import DocumentEncoder
tokenizer = Tokenizer.from_file(tokenizer_path)
model = (FAST_BACKENDS[backend].make(tokenizer, tokenizer_sha256(tokenizer), "text")
         if backend in FAST_BACKENDS else DocumentEncoder(tokenizer, None, None, "text"))
encode = getattr(model, "encode_flat", None) or model.encode
texts = []
for path in sorted(glob.glob(corpus + "/*.parquet")):
    texts += clean_texts(pq.read_table(path, columns=["text"]).column(0), 10_000_000)[0]
started, tokens = time.process_time(), 0
for first in range(0, len(texts), 1024):  # the units' call: encode_batch_rows texts
    ids, _ = encode(texts[first:first + 1024])
    tokens += ids.size
print(json.dumps({"cpu": time.process_time() - started, "tokens": tokens,
                  "documents": len(texts)}))
"""

READ_ENCODE_WRITE = """
import glob, json, os, sys, time
import numpy as np
import pyarrow.parquet as pq
from tokenizers import Tokenizer
from raypipe.preprocess.encoding.backends import FAST_BACKENDS
from raypipe.preprocess.encoding.encoder import tokenizer_sha256
corpus, tokenizer_path, backend, output = sys.argv[1:5]
tokenizer = Tokenizer.from_file(tokenizer_path)
model = FAST_BACKENDS[backend].make(tokenizer, tokenizer_sha256(tokenizer), "text")
arrow = getattr(model, "encode_arrow", None)  # the backend's fastest call, as the units'
dtype = np.uint16 if tokenizer.get_vocab_size() <= 1 << 16 else np.uint32
os.makedirs(output, exist_ok=True)
started, tokens, documents = time.process_time(), 0, 0
for index, path in enumerate(sorted(glob.glob(corpus + "/*.parquet"))):
    pieces = []  # one thread, as a unit reads: 1,024 rows at a time
    for batch in pq.ParquetFile(path).iter_batches(1024, columns=["text"], use_threads=False):
        texts = batch.column(0)
        ids, _ = arrow(texts) if arrow else model.encode_flat(texts.to_pylist())
        pieces.append(ids)
        documents += len(texts)
    ids = np.concatenate(pieces).astype(dtype)
    ids.tofile(os.path.join(output, f"{index}.bin"))
    tokens += ids.size
print(json.dumps({"cpu": time.process_time() - started, "tokens": tokens,
                  "documents": documents}))
"""

DATATROVE_JOB = """
import sys
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import ParquetReader
from datatrove.pipeline.tokens import DocumentTokenizer
corpus, output, tokenizer, eos, logs = sys.argv[1:6]
LocalPipelineExecutor(pipeline=[
    ParquetReader(corpus, text_key="text", id_key="id"),
    DocumentTokenizer(output, tokenizer_name_or_path=tokenizer, eos_token=eos,
                      shuffle_documents=False)],
    tasks=16, workers=2, logging_dir=logs, skip_completed=False).run()
"""


def fresh_env(workdir: Path) -> dict[str, str]:
    """A child's environment: its own Ray temp dir, no auth token, Ray on loopback."""
    import tempfile

    parent = os.environ.get("RAY_TMPDIR", "/tmp")  # inside the caller's own, if any (tests)
    os.makedirs(parent, exist_ok=True)  # Ray makes its temp dir when it starts; do as it does
    ray_tmpdir = tempfile.mkdtemp(prefix="rp-", dir=parent)
    return {**os.environ, "RAY_TMPDIR": ray_tmpdir,
            "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def process_tree_ticks(roots: list[int]) -> dict[int, int]:
    """pid -> CPU ticks used so far, for `roots` and all their descendants (from /proc)."""
    parents, ticks = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = int(fields[1])
            ticks[int(entry)] = int(fields[11]) + int(fields[12])
    inside = set(roots)
    for pid in sorted(parents):  # children have larger pids, except after wrap-around
        if parents[pid] in inside:
            inside.add(pid)
    return {pid: ticks[pid] for pid in inside if pid in ticks}


class TreeCPU:
    """Core-seconds used from now on by processes and all their descendants (a local Ray's
    GCS, raylet, agents and workers; a running cluster's), sampled from /proc every `every`
    seconds: workers orphaned at shutdown are never reaped into the parent's rusage."""

    def __init__(self, roots: list[int], every: float = 0.1):
        self.roots, self.every = roots, every
        self.before = self._tree_ticks()  # what the processes running already had used
        self.ticks: dict[int, int] = dict(self.before)  # pid -> its last sampled ticks
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(self.every):
            self.ticks.update(self._tree_ticks())

    def _tree_ticks(self) -> dict[int, int]:
        return process_tree_ticks(self.roots)

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        used = sum(self.ticks.values()) - sum(self.before.values())
        return used / os.sysconf("SC_CLK_TCK")


def run_raypipe(corpus: Path, output: Path, tokenizer: Path, backend: str,
                batch_size: int = BATCH, cluster: Cluster | None = None) -> dict:
    shutil.rmtree(output, ignore_errors=True)
    size = sum(p.stat().st_size for p in corpus.glob("*.parquet"))
    unit_bytes = max(2 << 20, size // 32)  # ~32 units: both actors busy to the end
    env = cluster.env if cluster is not None else fresh_env(output.parent)
    began = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-c", RAYPIPE_JOB, str(corpus), str(output),
                                str(tokenizer), backend, str(batch_size), str(unit_bytes),
                                cluster.address if cluster is not None else ""],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
    cpu = TreeCPU([process.pid, *([cluster.process.pid] if cluster is not None else [])])
    stdout, stderr = process.communicate()
    wall = time.perf_counter() - began
    core_seconds = cpu.stop()
    if process.returncode:
        raise RuntimeError(f"the raypipe job failed ({process.returncode}): {stderr[-2000:]}")
    return {**json.loads(stdout.strip().splitlines()[-1]), "wall": wall,
            "core_seconds": core_seconds}


STARTED = "Ray runtime started."  # what `ray start` prints once its node is registered


class Cluster:
    """A running Ray cluster on loopback (`ray start --head --block`, 2 CPUs), stopped by
    its own process (never `ray stop`, which would end every Ray on the machine)."""

    def __init__(self, workdir: Path):
        port = free_port()
        self.env = fresh_env(workdir)
        self.address = f"127.0.0.1:{port}"
        # its agents on free ports: on Ray's defaults (52365, ...) every local Ray started
        # while it runs (the race's floor and raypipe's fresh-Ray runs) retried binding
        # them: 8.6 s to come up against 5.9-6.0 s (ray.init, 2 CPUs)
        agents = [f"--dashboard-agent-listen-port={free_port()}",
                  f"--dashboard-agent-grpc-port={free_port()}",
                  f"--runtime-env-agent-port={free_port()}",
                  f"--metrics-export-port={free_port()}"]
        log = Path(self.env["RAY_TMPDIR"]) / "ray-start.log"
        with open(log, "w") as output:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                 "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                 "--include-dashboard=false", *agents], env=self.env, stdout=output,
                stderr=subprocess.STDOUT)
        # `ray start` says so once its raylet has registered at the GCS (it waits for that)
        deadline = time.monotonic() + 60
        while STARTED not in log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start --head did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Kill the cluster's processes at once. Measured: `ray start --block` given SIGTERM
        after a job had run against it took 31 s to stop gracefully (2 s with no job); the
        cluster is this bench's own, with its own temp dir, so nothing needs its grace."""
        tree = process_tree_ticks([self.process.pid])
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=60)


def run_unit_rate(corpus: Path, workdir: Path, tokenizer: Path, backend: str,
                  profile: bool = False) -> dict:
    """The units of a serial job (this machine's one process, no Ray) on `backend`: their
    CPU seconds as their records count them, and (profile) where their CPU went."""
    output = workdir / f"unit-rate-{backend}"
    shutil.rmtree(output, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", UNIT_RATE_JOB, str(corpus), str(output),
                           str(tokenizer), backend, "1" if profile else ""],
                          capture_output=True, text=True, env=fresh_env(workdir), check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_read_encode_write(corpus: Path, workdir: Path, tokenizer: Path, backend: str
                          ) -> dict:
    """The least a unit must do, in a fresh process: read each parquet file's texts, encode
    them with the backend's fastest call (1,024 texts a call, as the units), write a .bin
    per file; nothing else (no bad-row checks, separators, digests, fsync or records). Its
    CPU seconds (the whole process's)."""
    output = workdir / f"read-encode-write-{backend}"
    shutil.rmtree(output, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", READ_ENCODE_WRITE, str(corpus),
                           str(tokenizer), backend, str(output)], capture_output=True,
                          text=True, env=fresh_env(workdir), check=True)
    shutil.rmtree(output, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_bare_call(corpus: Path, workdir: Path, tokenizer: Path, backend: str) -> dict:
    """The backend's own batch call on the same texts (in memory), in a fresh process: its
    CPU seconds (the whole process's, any pool thread included)."""
    done = subprocess.run([sys.executable, "-c", BARE_CALL, str(corpus), str(tokenizer),
                           backend], capture_output=True, text=True,
                          env=fresh_env(workdir), check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


PROFILE_PARTS = (  # (part, test on "path:function") in order; the first that matches
    ("encoding (the backend's call and its output arrays)",
     lambda key: "awkward" in key or (key.startswith("~:") and "encode" in key)),
    ("reading parquet / JSON lines", lambda key: "parquet" in key or "jsonl" in key
     or "unit_batches" in key or "pyarrow/fs" in key),
    ("finding null, invalid and too-long rows, counting literals",
     lambda key: "texts.py" in key or "compute.py" in key or "count_special" in key),
    ("adding separators", lambda key: "with_separators" in key),
    ("sha256 of the shards", lambda key: "HASH" in key or "hashlib" in key),
    ("writing shards (files, fsync, index)", lambda key: "fsync" in key or "write" in key
     or "shards.py" in key or "/formats/" in key or "atomic" in key),
)


def profile_lines(where: dict[str, float]) -> list[str]:
    """Where the units' CPU went, by part, from a profile's own times."""
    totals = {part: 0.0 for part, _ in PROFILE_PARTS} | {"everything else": 0.0}
    for key, seconds in where.items():
        part = next((name for name, test in PROFILE_PARTS if test(key)), "everything else")
        totals[part] += seconds
    whole = sum(totals.values()) or 1.0
    return [f"  {seconds:7.3f} s  {seconds / whole:5.1%}  {part}"
            for part, seconds in totals.items()]


def run_datatrove(corpus: Path, workdir: Path, tokenizer: Path, eos: str) -> float | None:
    try:
        import datatrove  # noqa: F401
    except ImportError:
        return None
    output, logs = workdir / "datatrove", workdir / "datatrove-logs"
    shutil.rmtree(output, ignore_errors=True)
    shutil.rmtree(logs, ignore_errors=True)
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", DATATROVE_JOB, str(corpus), str(output),
                    str(tokenizer), eos, str(logs)], capture_output=True, text=True,
                   env=fresh_env(workdir), check=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=Path("bench_out"))
    parser.add_argument("--repeats", type=int, default=2, help="best of N for each side")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="whose ceiling, library loop and raypipe run to measure "
                             "(fastokens: raypipe's default `auto`); e.g. `fastokens` alone "
                             "for large corpora")
    parser.add_argument("--tokenizer", choices=list(EOS), default="gpt2")
    parser.add_argument("--corpus", choices=["unique", "shuffled", "docstrings"],
                        default="unique",
                        help="unique: the machine's text, no document twice (as much as it "
                             "holds, up to --mb); shuffled: that, then new documents made "
                             "by shuffling its documents' sentences, to --mb (1024: the "
                             "1 GB run); docstrings: repeated to --mb")
    parser.add_argument("--gpt2-dir", type=Path, default=None,
                        help="a folder with GPT-2's encoder.json and vocab.bpe")
    parser.add_argument("--skip-datatrove", action="store_true",
                        help="leave datatrove out (its runs are the longest)")
    parser.add_argument("--cluster", action="store_true",
                        help="also run raypipe (auto) against a running cluster "
                             "(`ray start --head`, then `address`), as `ray job submit` does")
    parser.add_argument("--units-only", action="store_true",
                        help="measure the units against the bare call and read + encode + "
                             "write, and nothing else")
    parser.add_argument("--megatron", type=Path, default=None,
                        help="a Megatron-LM checkout (d98e8a6): race its gigatoken fast "
                             "path against raypipe as typed, with Ray's floor, and nothing "
                             "else (bench/megatron_race.py)")
    parser.add_argument("--megatron-python", type=Path, default=None,
                        help="the Python 3.12 venv's python that runs Megatron's fast path")
    args = parser.parse_args()
    args.workdir.mkdir(exist_ok=True)
    corpus = {"unique": unique_corpus, "shuffled": shuffled_corpus,
              "docstrings": docstring_corpus}[args.corpus](args.workdir, args.mb << 20)
    size = sum(p.stat().st_size for p in corpus.glob("*.parquet"))
    tokenizer = bench_tokenizer(args.tokenizer, args.workdir, corpus, args.gpt2_dir)
    eos = EOS[args.tokenizer]
    print(f"corpus: {corpus} ({size / 1e6:.1f} MB parquet); tokenizer {tokenizer}")
    if args.megatron is not None or args.megatron_python is not None:
        cluster = Cluster(args.workdir) if args.cluster else None
        try:
            race(corpus, args.workdir, tokenizer, args.megatron, args.megatron_python,
                 args.repeats, lambda: fresh_env(args.workdir), cluster, args.mb)
        finally:
            if cluster is not None:
                cluster.stop()
        return
    chosen = [name for name in BACKENDS if name in args.backends.split(",")]
    ceilings: dict[str, list] = {name: [] for name in chosen}
    loops: dict[str, list] = {name: [] for name in chosen}
    jobs: dict[str, list] = {JOB_BACKEND[name]: [] for name in chosen}
    datatrove: list[float] = []
    unit_rates = measure_unit_rates(corpus, args.workdir, tokenizer, chosen, args.repeats)
    if args.units_only:
        report_unit_rates(unit_rates)
        return
    small = run_raypipe(corpus, args.workdir / "raypipe-rss-small", tokenizer, "auto", 64)
    for _ in range(args.repeats):  # alternate, so every contender sees the same noise
        for backend in ceilings:
            ceilings[backend].append(run_ceiling(corpus, args.workdir, tokenizer, eos, backend))
            loops[backend].append(run_ceiling(corpus, args.workdir, tokenizer, eos, backend,
                                              loop_worker))
        for backend in jobs:
            jobs[backend].append(run_raypipe(corpus, args.workdir / "raypipe", tokenizer,
                                             backend))
        seconds = (None if args.skip_datatrove
                   else run_datatrove(corpus, args.workdir, tokenizer, eos))
        if seconds is not None:
            datatrove.append(seconds)
    on_cluster = []
    if args.cluster:
        cluster = Cluster(args.workdir)
        try:
            run_raypipe(corpus, args.workdir / "raypipe-warm", tokenizer, "auto",
                        cluster=cluster)  # the cluster's workers imported once, untimed
            on_cluster = [run_raypipe(corpus, args.workdir / "raypipe", tokenizer, "auto",
                                      cluster=cluster) for _ in range(args.repeats)]
        finally:
            cluster.stop()
    report(ceilings, loops, jobs, datatrove, small, size, on_cluster)
    report_unit_rates(unit_rates)


def measure_unit_rates(corpus: Path, workdir: Path, tokenizer: Path, backends: list[str],
                       repeats: int) -> dict:
    """Per backend (and `auto`): the best of `repeats` serial jobs' unit CPU and bare
    calls' CPU, alternated; one profiled run of `auto`'s units."""
    units: dict[str, dict] = {}
    bare: dict[str, dict] = {}
    least: dict[str, dict] = {}  # read + encode + write
    for _ in range(repeats):
        for backend in [*backends, "auto"]:
            keep_best(units, backend, run_unit_rate(corpus, workdir, tokenizer, backend))
            if backend != "auto":
                keep_best(bare, backend, run_bare_call(corpus, workdir, tokenizer, backend))
                keep_best(least, backend,
                          run_read_encode_write(corpus, workdir, tokenizer, backend))
    profile = run_unit_rate(corpus, workdir, tokenizer, "auto", profile=True)
    return {"units": units, "bare": bare, "least": least, "profile": profile}


def keep_best(best: dict[str, dict], backend: str, run: dict) -> None:
    """Keep `run` as `backend`'s if it took the least CPU so far."""
    if backend not in best or run["cpu"] < best[backend]["cpu"]:
        best[backend] = run


def report_unit_rates(measured: dict) -> None:
    """The units' rate (content tokens per CPU second, as their records count it) against
    the bare call of the same backend and of the fastest backend, on the same texts."""
    units, bare = measured["units"], measured["bare"]

    def rate(run: dict, separators: bool) -> float:
        content = run["tokens"] - (run["documents"] if separators else 0)  # EOS each
        return content / run["cpu"]

    least = measured["least"]
    rows = [("backend", "bare call M tok/CPU-s", "read + encode + write M tok/CPU-s",
             "units M tok/CPU-s", "units / bare call", "units / read + encode + write")]
    for name, call in bare.items():
        unit_rate = rate(units[name], True)
        rows.append((name, f"{rate(call, False) / 1e6:.2f}",
                     f"{rate(least[name], False) / 1e6:.2f}", f"{unit_rate / 1e6:.2f}",
                     f"{unit_rate / rate(call, False):.2f}",
                     f"{unit_rate / rate(least[name], False):.2f}"))
    print("\nunits (a serial job, one process, no Ray) against the bare call and against "
          "read + encode + write, on the same texts:")
    print_table(rows)
    auto = units["auto"]
    if auto["backend"] in least:
        against = rate(auto, True) / rate(least[auto["backend"]], False)
        print(f"RATIO units (auto = {auto['backend']}) / read + encode + write = "
              f"{against:.2f} (target >= 0.8): "
              f"{'PASS' if against >= 0.8 else 'BELOW TARGET'}")
    fastest = max(bare, key=lambda name: rate(bare[name], False))
    own = rate(auto, True) / rate(bare[auto["backend"]], False) if auto["backend"] in bare \
        else float("nan")
    best = rate(auto, True) / rate(bare[fastest], False)
    print(f"RATIO units (auto = {auto['backend']}) / its own bare call = {own:.2f} "
          f"(target >= 0.8): {'PASS' if own >= 0.8 else 'BELOW TARGET'}")
    print(f"RATIO units (auto = {auto['backend']}) / the fastest bare call ({fastest}) = "
          f"{best:.2f}; auto is the fastest exact backend installed: "
          f"{'YES' if auto['backend'] == fastest else 'NO'}")
    print(f"where auto's units spent their CPU (a profile's own times; {auto['backend']}):")
    print("\n".join(profile_lines(measured["profile"]["where"])))


def bench_tokenizer(name: str, workdir: Path, corpus: Path, gpt2_dir: Path | None) -> Path:
    """GPT-2's tokenizer.json, the shipped one, or a Llama-3-style `Split`-regex BPE of 32k
    trained on (the first 50 MB of) the corpus once."""
    if name == "gpt2":
        return gpt2_tokenizer_json(workdir, gpt2_dir)
    if name == "shipped":
        return SHIPPED
    path = workdir / f"llama3-style-{corpus.name}.json"
    if not path.exists():
        texts, chars = [], 0
        for file_texts in corpus_texts(corpus):
            texts += file_texts
            chars += sum(map(len, file_texts))
            if chars > 50_000_000:
                break
        train_bpe(texts, 32_000, LLAMA3_SPLIT).save(str(path))
    return path


def core_seconds_line(job: dict, ceiling_wall: float) -> str:
    """Where the run's core-seconds went, and the end-to-end ratio that the CPU spent outside
    units allows even if units ran at the ceiling's rate and no core were ever idle."""
    busy, units = job["core_seconds"], job["unit_cpu"]
    other, idle = max(busy - units, 0.0), max(CORES * job["wall"] - busy, 0.0)
    cap = ceiling_wall / (ceiling_wall + other / CORES)
    return (f"core-seconds of the end-to-end run ({CORES} cores x {job['wall']:.2f} s): "
            f"{units:.3f} tokenizing units, {other:.1f} everything else (Ray's and Ray Data's "
            f"processes, the driver outside units), {idle:.1f} idle; that other CPU alone "
            f"caps end to end at {cap:.2f} of the ceiling")


def report(ceilings: dict, loops: dict, jobs: dict, datatrove: list[float], small: dict,
           size: int, on_cluster: list[dict]) -> None:
    best = {name: min(runs) for name, runs in ceilings.items()}
    ceiling_rate = {name: tokens / wall for name, (wall, tokens) in best.items()}
    loop_best = {name: min(runs) for name, runs in loops.items()}
    rows = [("what", "tokens", "seconds", "M tokens/s", "vs ceiling of its backend")]
    for name, (wall, tokens) in best.items():
        rows.append((f"ceiling, {name}: 2 processes", f"{tokens:,}", f"{wall:.2f}",
                     f"{tokens / wall / 1e6:.3f}", "1.00"))
    for name, (wall, tokens) in loop_best.items():
        rows.append((f"library loop, {name}: 2 processes", f"{tokens:,}", f"{wall:.2f}",
                     f"{tokens / wall / 1e6:.3f}", f"{tokens / wall / ceiling_rate[name]:.2f}"))
    fastest = {}
    for name, runs in jobs.items():
        job = min(runs, key=lambda j: j["wall"])
        fastest[name] = job
        backend = job["backend"]
        wall_rate = job["tokens"] / job["wall"]
        unit_rate = job["tokens"] / job["unit_cpu"] * CORES  # a core each, as the ceiling
        rows.append((f"raypipe {name} ({backend}), end to end", f"{job['tokens']:,}",
                     f"{job['wall']:.2f}", f"{wall_rate / 1e6:.3f}",
                     f"{wall_rate / ceiling_rate[backend]:.2f}"))
        rows.append((f"raypipe {name} ({backend}), its units' CPU time / {CORES}",
                     f"{job['tokens']:,}", f"{job['unit_cpu'] / CORES:.2f}",
                     f"{unit_rate / 1e6:.3f}", f"{unit_rate / ceiling_rate[backend]:.2f}"))
    if on_cluster:
        job = min(on_cluster, key=lambda j: j["wall"])
        rate = job["tokens"] / job["wall"]
        rows.append((f"raypipe auto ({job['backend']}) on a running cluster, end to end",
                     f"{job['tokens']:,}", f"{job['wall']:.2f}", f"{rate / 1e6:.3f}",
                     f"{rate / ceiling_rate[job['backend']]:.2f}"))
    if datatrove:
        seconds = min(datatrove)
        rows.append(("datatrove, end to end", "", f"{seconds:.2f}", "", ""))
    print_table(rows)
    unit_targets(fastest, loop_best)
    job = fastest.get("auto") or next(iter(fastest.values()))
    print(f"Ray start-up inside the raypipe runs: {job['ray_start']:.2f} s")
    ceiling_wall = best[job["backend"]][0]
    print(core_seconds_line(job, ceiling_wall))
    print(f"Ray Data start-up (pipeline launched -> first record): {job['data_start']:.2f} s; "
          f"all {job['units']} units ran on Ray Data")
    if on_cluster:
        cluster_job = min(on_cluster, key=lambda j: j["wall"])
        rate = cluster_job["tokens"] / cluster_job["wall"]
        ratio = rate / ceiling_rate[cluster_job["backend"]]
        print(f"on the running cluster, {core_seconds_line(cluster_job, ceiling_wall)}")
        print(f"RATIO raypipe on a running cluster/ceiling = {ratio:.2f} (target >= 0.85): "
              f"{'PASS' if ratio >= 0.85 else 'BELOW TARGET'} (Ray Data start-up "
              f"{cluster_job['data_start']:.2f} s)")
    print(f"peak RSS per actor: batch 64 -> {small['rss'] / 2**20:.0f} MiB, batch {BATCH} -> "
          f"{job['rss'] / 2**20:.0f} MiB (corpus {size / 2**20:.0f} MiB)")
    ratio = job["tokens"] / job["wall"] / ceiling_rate[job["backend"]]
    print(f"RATIO raypipe/ceiling ({job['backend']}, end to end) = {ratio:.2f} (goal >= "
          f"0.6 at 1 GB): {'PASS' if ratio >= 0.6 else 'BELOW TARGET'}")
    if datatrove:
        speedup = min(datatrove) / job["wall"]
        print(f"RATIO datatrove time / raypipe time = {speedup:.2f} (goal >= 4): "
              f"{'PASS' if speedup >= 4 else 'BELOW TARGET'}")


def unit_targets(fastest: dict, loop_best: dict) -> None:
    """The hard target: the units' per-core rate under auto against the tiktoken loop's,
    and their CPU seconds against the tiktoken job's."""
    auto, tiktoken_job = fastest.get("auto"), fastest.get("tiktoken")
    if auto is None or "tiktoken" not in loop_best:
        return
    wall, tokens = loop_best["tiktoken"]
    unit_rate = auto["tokens"] / auto["unit_cpu"] * CORES
    ratio = unit_rate / (tokens / wall)
    print(f"RATIO units' per-core rate, auto ({auto['backend']}) / tiktoken loop = "
          f"{ratio:.2f} (target >= 3): {'PASS' if ratio >= 3 else 'BELOW TARGET'}")
    if tiktoken_job is not None:
        share = auto["unit_cpu"] / tiktoken_job["unit_cpu"]
        print(f"RATIO units' CPU seconds, auto / tiktoken = {share:.2f} ({auto['unit_cpu']:.1f}"
              f" s / {tiktoken_job['unit_cpu']:.1f} s; target <= 0.33): "
              f"{'PASS' if share <= 1 / 3 else 'BELOW TARGET'}")


if __name__ == "__main__":
    main()
