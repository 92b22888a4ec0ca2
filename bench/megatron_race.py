"""raypipe against Megatron-LM's gigatoken fast path (`tools/preprocess_data_fast.py
--use-gigatoken`), end to end, alternating, with the fixed-cost floor of Ray and Ray Data
measured in the same run.

    python bench/tokenize_bench.py --megatron /path/to/Megatron-LM \\
        --megatron-python /path/to/py312-venv/bin/python [--mb 200] [--corpus shuffled]

Set-up, once (nothing of Megatron is committed here):
- Megatron-LM at d98e8a6 (NVIDIA/Megatron-LM #6514 added the fast path);
- a Python 3.12 venv (megatron.training needs `typing.override`) with torch, transformers,
  gigatoken (raypipe's own version) and awkward: `python3.12 -m venv v && v/bin/pip install
  torch transformers gigatoken==0.10.0 awkward`.
If either is missing the bench says so and still prints raypipe's side and the floor.

Each round runs, in fresh processes (launch to exit, the process tree's wall; each after
SETTLE_SECONDS at rest):
- the floor: `ray.init` as raypipe starts a local Ray (2 CPUs, loopback, no dashboard), then
  a Ray Data actor-pool map (2 actors, a CPU each, over `from_items`: no read task waits
  for a CPU, as in raypipe's job) of a function that does nothing, to its first record;
  with --cluster, the same against a running cluster (`ray.init(address=...)`) that has run
  one untimed floor and one untimed raypipe job first (what a cluster makes once: Ray Data's
  detached actors, raypipe's ledger);
- raypipe: `raypipe tokenize` as a user types it (parquet in, Megatron out, BOS off, EOS on,
  `--special-tokens-in-text special`, `--num-workers 2`, the unit size left to raypipe):
  with no Ray here, on local worker processes; then the same with `--executor ray` (a
  fresh local Ray), whose launch to first unit running (the earliest `started_at` of its
  unit records) is set against the floor; with --cluster, with `--address` too;
- Megatron's fast path on the same documents as one JSON-lines file (converted once, not
  counted), `RAYON_NUM_THREADS=2`, the same GPT-2 tokenizer as a Hugging Face folder,
  `--append-eod --tokenizer-hf-no-include-special-tokens`; its peak RSS.
Then the two outputs are compared token for token (every document's tokens, in order), and
byte for byte where raypipe wrote one shard. Targets (issue 55): raypipe's wall <= 0.5 of
Megatron's at 200 MB and <= 0.7 at >= 1 GB; start to first unit <= floor + 1 s (the
median over the rounds of each round's difference: a round's floor and raypipe run back to
back, so a drift of the machine's speed between rounds cancels).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from raypipe.formats.base import shard_prefix
from raypipe.formats.megatron import MegatronReader
from raypipe.io.manifest import read_manifest
from raypipe.io.store import Store

MEGATRON_COMMIT = "d98e8a6"
THREADS = 2  # Megatron's rayon threads, raypipe's workers, the floor's actors
# every contender starts on a machine at rest: the previous run's processes gone (a
# finished job's Ray workers are killed by its raylet, a local Ray's daemons exit after
# its driver), not still using the 2 cores the next run's start-up needs
SETTLE_SECONDS = 2.0

FLOOR = """
import sys, time
import ray
address = sys.argv[1] or None
if address:  # as raypipe.ray.session connects
    ray.init(address=address, log_to_driver=True)
else:
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=True)
up = time.time()

class Nothing:
    def __call__(self, batch):
        return batch

rows = ray.data.from_items([{"x": 0}, {"x": 1}], override_num_blocks=2).map_batches(
    Nothing, compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1, batch_size=1)
rows.context.enable_progress_bars = False
next(iter(rows.iter_batches(batch_size=None)))
print(up, time.time(), flush=True)
"""


@dataclass(frozen=True)
class Timed:
    """One fresh process: its wall (launch to exit) and the moments it reported, in
    seconds after its launch (at `launched_at`, epoch seconds)."""

    wall: float
    marks: tuple[float, ...] = ()
    peak_rss: int = 0
    launched_at: float = 0.0


def run_timed(command: list[str], env: dict[str, str], cwd: Path | None = None) -> tuple[
        Timed, str]:
    """Run `command` to its exit (after SETTLE_SECONDS at rest); its stdout's last line, if
    it is numbers, gives the moments (epoch seconds) it marked."""
    time.sleep(SETTLE_SECONDS)
    launched, began = time.time(), time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=cwd)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - began
    stdout, stderr = process.stdout.read(), process.stderr.read()  # type: ignore[union-attr]
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{command[:3]} failed: {stderr[-2000:]}")
    last = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    try:
        marks = tuple(float(each) - launched for each in last.split())
    except ValueError:
        marks = ()
    return Timed(wall, marks, usage.ru_maxrss * 1024, launched), stdout


def floor(env: dict[str, str], address: str = "") -> Timed:
    """Ray's and Ray Data's own fixed cost: marks (Ray up, first record of a no-op map)."""
    return run_timed([sys.executable, "-c", FLOOR, address], env)[0]


def raypipe_job(corpus: Path, output: Path, tokenizer: Path, env: dict[str, str],
                address: str = "", executor: str = "auto") -> Timed:
    """`raypipe tokenize` as typed (`auto`: local processes where no Ray is around; `ray`:
    a fresh local Ray): marks (first unit started) from its unit records."""
    import shutil

    shutil.rmtree(output, ignore_errors=True)
    command = [str(Path(sys.executable).with_name("raypipe")), "tokenize", str(corpus),
               "--output", str(output), "--tokenizer", str(tokenizer), "--format",
               "megatron", "--no-bos", "--eos", "--special-tokens-in-text", "special",
               "--num-workers", str(THREADS), "--executor", executor,
               *(["--address", address] if address else [])]
    timed, _ = run_timed(command, env)
    starts = [json.loads(path.read_text())["started_at"]
              for path in (output / "_units").glob("*.json") if path.name != "_job.json"]
    return dataclasses.replace(timed, marks=(min(starts) - timed.launched_at,))


def jsonl_copy(corpus: Path, workdir: Path) -> Path:
    """The corpus's documents, in raypipe's order (files sorted, rows in order), as the
    one JSON-lines file Megatron's fast path reads; made once."""
    path = workdir / f"{corpus.name}.jsonl"
    if not path.exists():
        partial = path.with_suffix(".partial")
        with open(partial, "w", encoding="utf-8") as handle:
            for file in sorted(corpus.glob("*.parquet")):
                for text in pq.read_table(file, columns=["text"]).column(0).to_pylist():
                    handle.write(json.dumps({"text": text}) + "\n")
        partial.rename(path)
    return path


def hf_folder(tokenizer: Path, workdir: Path) -> Path:
    """The tokenizer.json as the Hugging Face folder Megatron's HuggingFaceTokenizer loads."""
    folder = workdir / "gpt2-hf"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    return folder


def megatron_missing(repo: Path | None, python: Path | None) -> str | None:
    """Why Megatron's fast path cannot run here (None: it can)."""
    if repo is None or not (repo / "tools" / "preprocess_data_fast.py").exists():
        return (f"no Megatron-LM checkout with tools/preprocess_data_fast.py at {repo} "
                f"(fetch NVIDIA/Megatron-LM at {MEGATRON_COMMIT})")
    if python is None or not python.exists():
        return f"no Python for Megatron at {python} (a 3.12 venv: see this file's docstring)"
    probe = subprocess.run([str(python), "-c", "import torch, transformers, gigatoken, "
                            "awkward, typing; typing.override"], capture_output=True,
                           text=True)
    if probe.returncode:
        return f"{python} lacks what the fast path imports: {probe.stderr.strip()[-300:]}"
    return None


def megatron_job(repo: Path, python: Path, jsonl: Path, folder: Path, prefix: Path,
                 env: dict[str, str]) -> Timed:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    command = [str(python), "tools/preprocess_data_fast.py", "--input", str(jsonl),
               "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
               "--tokenizer-model", str(folder), "--tokenizer-hf-no-include-special-tokens",
               "--use-gigatoken", "--append-eod"]
    return run_timed(command, {**env, "RAYON_NUM_THREADS": str(THREADS)}, cwd=repo)[0]


def compare_outputs(raypipe_output: Path, megatron_prefix: Path) -> str:
    """Whether raypipe's Megatron shards hold Megatron's documents, token for token (and
    byte for byte where raypipe wrote one shard)."""
    manifest = read_manifest(Store(str(raypipe_output)))
    section = manifest.formats["megatron"]
    readers = [MegatronReader(shard_prefix(raypipe_output, shard)) for shard in section.shards]
    theirs = MegatronReader(f"{megatron_prefix}_text_document")
    ours_lengths = np.concatenate([r.document_lengths for r in readers])
    ours_tokens = np.concatenate([np.asarray(r.tokens) for r in readers])
    if not np.array_equal(ours_lengths, theirs.document_lengths):
        return (f"DIFFERENT: {ours_lengths.size:,} documents against Megatron's "
                f"{theirs.document_lengths.size:,}, or their lengths differ")
    if ours_tokens.dtype != theirs.tokens.dtype or not np.array_equal(ours_tokens,
                                                                      theirs.tokens):
        return "DIFFERENT: the same document lengths, other tokens"
    if len(readers) == 1:
        same = all(Path(ours).read_bytes() == Path(other).read_bytes()
                   for ours, other in ((readers[0].bin_path, theirs.bin_path),
                                         (readers[0].idx_path, theirs.idx_path)))
        return ("IDENTICAL bytes (.bin and .idx)" if same else
                "IDENTICAL tokens and document lengths; the .idx bytes differ")
    return (f"IDENTICAL tokens and document lengths: {ours_lengths.size:,} documents, "
            f"{ours_tokens.size:,} tokens, raypipe's {len(readers)} shards in manifest order "
            "against Megatron's one file")


def race(corpus: Path, workdir: Path, tokenizer: Path, repo: Path | None,
         python: Path | None, repeats: int, env_of, cluster=None, text_mb: int = 200
         ) -> None:
    """Alternate floor, raypipe and Megatron `repeats` times; print the table and ratios."""
    missing = megatron_missing(repo, python)
    if missing:
        print(f"Megatron's fast path: not run: {missing}")
    jsonl = folder = None
    if missing is None:
        jsonl, folder = jsonl_copy(corpus, workdir), hf_folder(tokenizer, workdir)
    if cluster is not None:  # what the cluster makes once, for every later job, made here
        # untimed (Ray Data's detached actors, raypipe's ledger): a running cluster has run
        # jobs before, and the first round's floor would pay it alone
        floor(cluster.env, cluster.address)
        raypipe_job(corpus, workdir / "race-raypipe-cluster", tokenizer, cluster.env,
                    cluster.address)
    runs: dict[str, list[Timed]] = {"floor": [], "raypipe, fresh Ray": [], "raypipe": [],
                                    "megatron": [], "floor, cluster": [],
                                    "raypipe, cluster": []}
    for _ in range(repeats):
        runs["floor"].append(floor(env_of()))
        runs["raypipe, fresh Ray"].append(raypipe_job(
            corpus, workdir / "race-raypipe-ray", tokenizer, env_of(), executor="ray"))
        runs["raypipe"].append(raypipe_job(corpus, workdir / "race-raypipe", tokenizer,
                                           env_of()))
        if missing is None:
            runs["megatron"].append(megatron_job(repo, python, jsonl, folder,
                                                 workdir / "race-megatron" / "out", env_of()))
        if cluster is not None:
            runs["floor, cluster"].append(floor(cluster.env, cluster.address))
            runs["raypipe, cluster"].append(raypipe_job(
                corpus, workdir / "race-raypipe-cluster", tokenizer, cluster.env,
                cluster.address))
    report(runs, corpus, text_mb)
    if missing is None:
        print("outputs (--special-tokens-in-text special): "
              + compare_outputs(workdir / "race-raypipe", workdir / "race-megatron" / "out"))


def median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def report(runs: dict[str, list[Timed]], corpus: Path, text_mb: int) -> None:
    size = sum(path.stat().st_size for path in corpus.glob("*.parquet"))
    print(f"\nraypipe against Megatron's fast path ({corpus.name}, {size / 1e6:.1f} MB of "
          f"parquet; medians of {len(runs['floor'])} alternating rounds, fresh processes):")
    for name, timed in runs.items():
        if not timed:
            continue
        walls = ", ".join(f"{t.wall:.2f}" for t in timed)
        extra = ""
        if name.startswith("floor"):
            extra = (f"; Ray up at {median([t.marks[0] for t in timed]):.2f} s, first record "
                     f"at {median([t.marks[1] for t in timed]):.2f} s")
        elif name.startswith("raypipe"):
            extra = f"; first unit running at {median([t.marks[0] for t in timed]):.2f} s"
        else:
            extra = f"; peak RSS {max(t.peak_rss for t in timed) / 2**30:.2f} GiB"
        print(f"  {name:17s} wall {median([t.wall for t in timed]):6.2f} s ({walls}){extra}")
    for where, name in (("", "raypipe, fresh Ray"), (", cluster", "raypipe, cluster")):
        job, base = runs[name], runs[f"floor{where}"]
        if job and base:  # each round's pair runs back to back: a drift of the machine's
            # speed between rounds (a shared VM's) cancels in the round's difference
            rounds = [run.marks[0] - floor_run.marks[1] for run, floor_run
                      in zip(job, base, strict=True)]
            above = median(rounds)
            print(f"RAYPIPE{where.upper()} start to first unit: {above:+.2f} s above the floor "
                  f"of Ray and Ray Data, median of the rounds' "
                  f"({', '.join(f'{each:+.2f}' for each in rounds)}; of the medians "
                  f"{median([t.marks[0] for t in job]) - median([t.marks[1] for t in base]):+.2f}"
                  f") (target <= 1 s): {'PASS' if above <= 1 else 'BELOW TARGET'}")
    target = 0.5 if text_mb < 1024 else 0.7  # the targets, by text size
    for name in ("raypipe", "raypipe, fresh Ray", "raypipe, cluster"):
        if runs["megatron"] and runs[name]:
            ratio = median([t.wall for t in runs[name]]) / median(
                [t.wall for t in runs["megatron"]])
            print(f"RATIO {name} wall / Megatron fast path wall = {ratio:.2f} (target <= "
                  f"{target}): {'PASS' if ratio <= target else 'BELOW TARGET'}")
