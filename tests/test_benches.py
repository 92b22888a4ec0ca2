"""Benchmarks run against today's API: each one at a tiny size, in a fresh process, writing
only under tmp_path (the figures themselves are the benchmarks' business, not the tests')."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_mixture_benchmark_runs_at_a_tiny_size(tmp_path):
    done = subprocess.run([sys.executable, "bench/mixture_bench.py", "--tokens", "300000",
                           "--steps", "5", "--repeats", "1", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split()[0] for line in done.stdout.splitlines()[2:] if line.strip()]
    assert rows == ["bestfit", "windows"], done.stdout


@pytest.mark.slow
def test_the_encode_paths_benchmark_runs_at_a_tiny_size(tmp_path):
    pytest.importorskip("gigatoken")
    done = subprocess.run([sys.executable, "bench/encode_paths_bench.py", "--mb", "1",
                           "--tokenizer", "shipped", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    table = lines[lines.index("gigatoken, one calling thread:") + 1:]
    assert "encode_arrow (the units' call)" in table[0], done.stdout
    assert next(line for line in table if line.startswith("all")).count("x)") == 4, table


@pytest.mark.ray
@pytest.mark.slow
def test_the_tokenize_benchmark_runs_at_a_tiny_size(tmp_path):
    done = subprocess.run([sys.executable, "bench/tokenize_bench.py", "--mb", "1",
                           "--tokenizer", "shipped", "--backends", "gigatoken",
                           "--skip-datatrove", "--repeats", "1", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("raypipe auto (gigatoken), end to end") for line in lines), \
        done.stdout
    accounting = next(line for line in lines if line.startswith("core-seconds"))
    tokenizing = float(accounting.split("s): ")[1].split(" tokenizing")[0])
    assert tokenizing > 0, accounting  # the units' CPU time reached the bench
    ratio = next(line for line in lines
                 if line.startswith("RATIO units (auto = gigatoken) / its own bare call"))
    assert float(ratio.split("own bare call = ")[1].split()[0]) > 0, ratio
    least = next(line for line in lines if line.startswith(
        "RATIO units (auto = gigatoken) / read + encode + write = "))
    assert float(least.split("write = ")[1].split()[0]) > 0, least
    parts = lines[lines.index(next(line for line in lines if line.startswith("where auto"))) + 1:]
    assert "encoding" in parts[0] and float(parts[0].split()[0]) > 0, parts[:7]


@pytest.mark.ray
@pytest.mark.slow
def test_the_chat_benchmark_runs_at_a_tiny_size(tmp_path):
    done = subprocess.run([sys.executable, "bench/chat_bench.py", "--conversations", "300",
                           "--tokenizer", "shipped", "--repeats", "1", "--seq-lens", "256",
                           "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens equal: True" in done.stdout, done.stdout
    assert "trained tokens equal: True" in done.stdout, done.stdout
    assert "equal transformers': 300 of 300 (ALL)" in done.stdout, done.stdout
    assert "shards of the local processes and of Ray byte-identical: True" in done.stdout
    packed = next(line for line in done.stdout.splitlines() if line.startswith("T=256"))
    cut = int(packed.split("conversations cut ")[1].split()[0])
    longer = int(packed.split("longer than a row: ")[1].rstrip(")"))
    assert "(split packing)" in packed and cut <= longer, packed  # only the overlong are cut


@pytest.mark.ray
@pytest.mark.slow
def test_the_ingest_benchmark_runs_at_a_tiny_size(tmp_path):
    done = subprocess.run([sys.executable, "bench/ingest_bench.py", "--files", "20",
                           "--big-mb", "1", "--units", "8", "--s3-files", "8",
                           "--latency-ms", "5", "--giant-mb", "2", "--pool-chars", "150000",
                           "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.strip().split("  ")[0] for line in done.stdout.splitlines()[1:]]
    assert rows == ["20 files + 1 MB", "same rows in 8 files", "8 units of one file",
                    "one unit (the fixed cost)", "one 2 MB row", "S3 +5 ms: plan 8 files",
                    "first run", "rerun of the finished output"], done.stdout
    assert "skipped {'too_long': 1}, 1 named" in done.stdout, done.stdout


@pytest.mark.parametrize("change", [[], ["--on-resume"],
                                    ["--balance", "attention", "--block-order", "by_cost",
                                     "--worlds", "1,2,3"],
                                    ["--shuffle", "windowed", "--lanes", "2", "--on-resume"]])
def test_the_every_token_once_script_passes_on_a_small_dataset(token_dataset, change):
    done = subprocess.run([sys.executable, "bench/every_token_once.py", str(token_dataset),
                           "--seq-lens", "16,64", "--ramp", "6,24,6,4", *change],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "EVERY TOKEN ONCE: PASS" in done.stdout and "more than once 0," in done.stdout
    assert f"run 3: {3 if '--balance' in change else 1} ranks" in done.stdout


@pytest.mark.slow
def test_the_changing_data_script_passes_on_a_small_dataset(token_dataset, tmp_path):
    done = subprocess.run([sys.executable, "bench/changing_data.py", str(token_dataset),
                           "--exclude", "40", "--seq-len", "64", "--rows", "6",
                           "--source-tokens", "60000", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CHANGING DATA: PASS" in done.stdout and "more than once 0," in done.stdout
    assert "resumed excluding the 40 documents trace named" in done.stdout
    assert "code dropped, books added; run 3" in done.stdout
    assert "excluding the 40 documents trace --history named" in done.stdout
    assert "books: epoch 0's tokens trained once" in done.stdout
    assert "trace --history of the final state alone rebuilds every step" in done.stdout
    assert "one written while it trains" in done.stdout and "joins of its units" in done.stdout
    for name in ("excluded.jsonl", "excluded-mixture.jsonl"):
        assert len((tmp_path / name).read_text().splitlines()) == 40


def test_the_megatron_race_tells_identical_documents_from_a_changed_token(
        tmp_path, corpus_dir, tokenizer_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from megatron_race import compare_outputs

    from raypipe.config import load_config
    from raypipe.dataset import TokenDataset
    from raypipe.formats.megatron import encode_index
    from raypipe.preprocess.job import run_job

    run_job(load_config(None, inputs=[str(corpus_dir)], output=str(tmp_path / "ours"),
                        tokenizer=tokenizer_path, formats=["megatron"], unit_bytes=1))
    dataset = TokenDataset(tmp_path / "ours", "megatron")
    documents = list(dataset.iter_documents())
    assert dataset.num_shards > 1
    tokens = np.concatenate(documents)
    lengths = np.array([len(document) for document in documents])
    prefix = tmp_path / "theirs" / "out"
    prefix.parent.mkdir()

    def write_theirs(ids: np.ndarray) -> None:  # one file, as Megatron's builder writes
        Path(f"{prefix}_text_document.bin").write_bytes(ids.tobytes())
        Path(f"{prefix}_text_document.idx").write_bytes(encode_index(lengths, ids.dtype))

    write_theirs(tokens)
    assert compare_outputs(tmp_path / "ours", prefix).startswith("IDENTICAL tokens")
    tokens[len(tokens) // 2] += 1
    write_theirs(tokens)
    assert compare_outputs(tmp_path / "ours", prefix).startswith("DIFFERENT")


def test_the_megatron_race_judges_the_fixed_cost_round_by_round(tmp_path, capsys):
    """The verdict is the median of each round's difference (raypipe's first unit minus
    that round's floor): a machine whose speed drifts between rounds (every mark of round
    two is 3 s later) moves both of a round's runs, not the verdict."""
    sys.path.insert(0, str(ROOT / "bench"))
    from megatron_race import Timed, report

    (tmp_path / "part.parquet").write_bytes(b"x" * 1000)
    floors = [Timed(5.0, (1.0, 3.0)), Timed(8.0, (4.0, 6.0)), Timed(5.0, (1.0, 3.2))]
    jobs = [Timed(9.0, (3.5,)), Timed(12.0, (6.6,)), Timed(9.0, (3.9,))]
    report({"floor": [], "raypipe, fresh Ray": [], "raypipe": [], "megatron": [],
            "floor, cluster": floors, "raypipe, cluster": jobs}, tmp_path, 100)
    verdict = next(line for line in capsys.readouterr().out.splitlines()
                   if line.startswith("RAYPIPE, CLUSTER"))
    assert "+0.60 s above the floor" in verdict and "(+0.50, +0.60, +0.70;" in verdict
    assert "of the medians +0.70" in verdict and verdict.endswith("PASS")


def test_the_checksum_benchmark_runs_at_a_tiny_size(tmp_path):
    done = subprocess.run([sys.executable, "bench/checksum_bench.py", "--tokens", "200000",
                           "--repeats", "1", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[1].startswith("writer:") and "x the writer without them" in lines[1]
    assert [line.split(":")[0] for line in lines[2:]] == ["reads in order", "reads shuffled"]


def test_the_balance_benchmark_runs_at_a_tiny_size(tmp_path):
    done = subprocess.run([sys.executable, "bench/balance_bench.py", "--steps", "32",
                           "--block-documents", "4096,16384", "--loader-tokens", "3000000",
                           "--loader-seq-len", "64", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    split = lines.index("")
    rows = [line.split() for line in lines[2:split]]
    # two distributions x two shapes x two world sizes, each none, attention, then a row
    # per block size ordered by cost
    assert len(rows) == 2 * 2 * 2 * 4, done.stdout
    assert [(row[-6], row[-5]) for row in rows[:4]] == [
        ("none", "shuffled"), ("attention", "shuffled"), ("attention", "by_cost"),
        ("attention", "by_cost")]
    described = [line.split() for line in lines[split + 3:-1]]
    assert [row[:2] for row in described] == [[mode, ranks] for mode in
                                              ("bestfit", "documents", "windows")
                                              for ranks in ("64", "512")], done.stdout


def test_the_lanes_benchmark_runs_at_a_tiny_size():
    done = subprocess.run([sys.executable, "bench/lanes_bench.py", "--documents", "20000",
                           "--lanes", "1,4", "--packing", "split"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert [row[0] for row in rows] == ["1", "4"] and rows[0][2] == rows[0][4] == "1.0"


def test_the_lane_ends_benchmark_reads_each_lanes_rest_on_fewer_nodes_than_spread():
    done = subprocess.run([sys.executable, "bench/lane_ends_bench.py", "--blocks", "3000",
                           "--lanes", "64", "--per-node", "8"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row[1]: row for row in (line.split() for line in done.stdout.splitlines()[2:])}
    assert set(rows) == {"spread", "nearby"}
    assert int(rows["nearby"][5]) <= 2 < int(rows["spread"][5])


@pytest.mark.slow
def test_the_retry_benchmark_runs_at_a_tiny_size():
    env = {key: value for key, value in os.environ.items() if key != "AWS_ENDPOINT_URL"}
    done = subprocess.run([sys.executable, "bench/retry_bench.py", "--reads", "2",
                           "--delay-ms", "2"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = [line.split("  ")[0] for line in done.stdout.splitlines()[2:] if line.strip()]
    assert rows == ["raypipe Store", "pyarrow from_uri"] * 3, done.stdout
